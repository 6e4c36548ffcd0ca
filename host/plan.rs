//! From a request to launches: the [`Plan`] of one allreduce — its
//! algorithm and the steps (chunks) it runs, each with its entry point and
//! block count — under the group's [`Config`]. Pure: no driver calls, so every rank computes the same plan
//! from the same arguments, as the barriers need.

use crate::abi::{island_split, Algorithm, Dtype, PACK_BYTES};
use crate::config::zone_setting;
pub use crate::config::{AlgoChoice, Config, Link, Thresholds};
use crate::error::{Error, Result};
use crate::ptx::Entry;

/// Blocks per rank for one collective: enough threads for the work of one
/// rank (the whole message for one-stage, one partition for two-stage), at
/// least one, at most `max_blocks`. Few blocks for small messages means few
/// flags to exchange. Every rank computes the same value from the same
/// inputs, which the barrier protocol requires.
pub fn blocks_for(
    algo: Algorithm,
    dtype: Dtype,
    count: usize,
    world: usize,
    threads: u32,
    max_blocks: u32,
) -> u32 {
    let packs = count.div_ceil(dtype.lanes()).max(1);
    let work = match algo {
        Algorithm::OneStage | Algorithm::Push | Algorithm::PushLl => packs,
        Algorithm::TwoStage | Algorithm::PushTwoStage => packs.div_ceil(world.max(1)),
        Algorithm::PushIslands => packs.div_ceil(island_split(world).max(1)),
    };
    (work.div_ceil(threads as usize) as u32).clamp(1, max_blocks)
}

/// How the inputs reach the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inputs {
    /// Copied into the group's staging buffers first: any buffer, in place
    /// allowed, messages above `max_bytes` chunked.
    Staged,
    /// Read by the peers where they are (registered buffers, or captured
    /// buffers registered after capture): one launch, no chunking.
    ZeroCopy,
}

/// One allreduce as the ranks asked for it.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    pub dtype: Dtype,
    /// Elements per rank.
    pub count: usize,
    pub world: usize,
    pub link: Link,
    /// All ranks in one launch on one GPU (`_virtual` entries).
    pub virtual_ranks: bool,
    pub inputs: Inputs,
    pub choice: AlgoChoice,
}

/// One launch of a plan: elements `[offset, offset + len)` of the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub offset: usize,
    pub len: usize,
    pub entry: Entry,
    /// Blocks per rank.
    pub blocks: u32,
}

/// Everything about one allreduce before anything runs: the one algorithm
/// of the whole message (chosen from its total size, so every chunk runs
/// the same one and the return value describes the whole call) and its
/// steps. Every rank computes the same plan from the same request.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub algorithm: Algorithm,
    request: Request,
    /// Elements per step (whole packs), the whole message for zero-copy.
    chunk: usize,
    blocks_cap: u32,
    threads: u32,
}

impl Plan {
    /// The plan of `request` under `config`, or the error that refuses it:
    /// a staged message above `max_bytes` with chunking off
    /// (`MessageTooLarge`), an explicit two-stage over zero-copy inputs
    /// whose scratch is too small (`ScratchTooSmall`; `Auto` runs one-stage
    /// there, with the same bits).
    pub fn new(config: &Config, request: Request) -> Result<Plan> {
        let size = request.dtype.size();
        let bytes = request.count * size;
        let mut algorithm = config.choose(request.choice, bytes, request.world, request.link);
        let chunk = match request.inputs {
            Inputs::Staged => {
                // A push chunk must fit the landing zones as well.
                let cap = config
                    .zone_capacity(algorithm)
                    .map_or(config.max_bytes, |z| config.max_bytes.min(z));
                if bytes > cap && !config.chunking {
                    return Err(Error::MessageTooLarge {
                        bytes,
                        capacity: cap,
                    });
                }
                ((cap / PACK_BYTES) * request.dtype.lanes()).max(1)
            }
            Inputs::ZeroCopy => {
                if let Some(capacity) = config.zone_capacity(algorithm) {
                    if bytes > capacity {
                        return Err(Error::ZoneTooSmall {
                            algorithm,
                            bytes,
                            capacity,
                            setting: zone_setting(algorithm),
                        });
                    }
                }
                if algorithm == Algorithm::TwoStage && bytes > config.max_bytes {
                    if request.choice == AlgoChoice::TwoStage {
                        return Err(Error::ScratchTooSmall {
                            bytes,
                            capacity: config.max_bytes,
                        });
                    }
                    algorithm = Algorithm::OneStage;
                }
                request.count.max(1)
            }
        };
        Ok(Plan {
            algorithm,
            request,
            chunk,
            blocks_cap: config.blocks_cap(request.link),
            threads: config.threads_per_block,
        })
    }

    /// The whole call as its tag summarises it (`crate::call_tag`): every
    /// step of the plan carries this one call's tag.
    pub fn call(&self) -> crate::call_tag::CallDesc {
        let r = &self.request;
        crate::call_tag::CallDesc::plain(r.count, r.dtype, self.algorithm)
    }

    /// The launches, in order. An empty message is one empty launch: every
    /// rank still meets the others.
    pub fn steps(&self) -> impl Iterator<Item = Step> + '_ {
        let count = self.request.count;
        let n = count.div_ceil(self.chunk).max(1);
        (0..n).map(move |k| {
            let offset = k * self.chunk;
            let len = (count - offset).min(self.chunk);
            let r = &self.request;
            Step {
                offset,
                len,
                entry: Entry {
                    op: crate::ptx::Op::Allreduce,
                    algorithm: self.algorithm,
                    dtype: r.dtype,
                    world: r.world,
                    virtual_ranks: r.virtual_ranks,
                },
                blocks: blocks_for(
                    self.algorithm,
                    r.dtype,
                    len,
                    r.world,
                    self.threads,
                    self.blocks_cap,
                ),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(count: usize, inputs: Inputs, choice: AlgoChoice) -> Request {
        Request {
            dtype: Dtype::F32,
            count,
            world: 2,
            link: Link::NvLink,
            virtual_ranks: false,
            inputs,
            choice,
        }
    }

    #[test]
    fn staged_plans_chunk_on_pack_boundaries_with_one_algorithm() {
        let c = Config {
            max_bytes: 40,
            ..Config::default()
        };
        // 40 bytes of capacity hold two whole f32 packs: 8 elements.
        let p = Plan::new(&c, request(20, Inputs::Staged, AlgoChoice::Auto)).expect("plan");
        let steps: Vec<(usize, usize)> = p.steps().map(|s| (s.offset, s.len)).collect();
        assert_eq!(steps, vec![(0, 8), (8, 8), (16, 4)]);
        assert!(p.steps().all(|s| s.entry.algorithm == p.algorithm));
        let empty = Plan::new(&c, request(0, Inputs::Staged, AlgoChoice::Auto)).expect("plan");
        assert_eq!(empty.steps().map(|s| s.len).collect::<Vec<_>>(), vec![0]);
        for (count, dtype, cap) in [
            (1_000_003usize, Dtype::Bf16, 65_536usize),
            (77, Dtype::F16, 32),
            (64, Dtype::F32, 256),
        ] {
            let c = Config {
                max_bytes: cap,
                ..Config::default()
            };
            let r = Request {
                dtype,
                ..request(count, Inputs::Staged, AlgoChoice::TwoStage)
            };
            let mut next = 0;
            for s in Plan::new(&c, r).expect("plan").steps() {
                assert_eq!(s.offset, next);
                assert_eq!((s.offset * dtype.size()) % PACK_BYTES, 0);
                assert!(s.len * dtype.size() <= cap);
                assert_eq!(s.entry.algorithm, Algorithm::TwoStage);
                next = s.offset + s.len;
            }
            assert_eq!(next, count);
        }
        let off = Config {
            max_bytes: 128,
            chunking: false,
            ..Config::default()
        };
        assert!(matches!(
            Plan::new(&off, request(33, Inputs::Staged, AlgoChoice::Auto)),
            Err(Error::MessageTooLarge {
                bytes: 132,
                capacity: 128
            })
        ));
    }

    #[test]
    fn zero_copy_plans_one_launch_and_refuse_what_does_not_fit() {
        let c = Config {
            max_bytes: 128,
            ..Config::default()
        };
        let p = Plan::new(&c, request(1000, Inputs::ZeroCopy, AlgoChoice::OneStage)).expect("plan");
        assert_eq!(p.steps().count(), 1);
        assert!(matches!(
            Plan::new(&c, request(1000, Inputs::ZeroCopy, AlgoChoice::TwoStage)),
            Err(Error::ScratchTooSmall {
                bytes: 4000,
                capacity: 128
            })
        ));
        let mut t = Thresholds::default();
        t.set_bands(Link::NvLink, 2, vec![band(usize::MAX, Algorithm::TwoStage)])
            .expect("valid bands");
        let c = Config { thresholds: t, ..c };
        let p = Plan::new(&c, request(1000, Inputs::ZeroCopy, AlgoChoice::Auto)).expect("plan");
        assert_eq!(
            p.algorithm,
            Algorithm::OneStage,
            "Auto falls back where scratch is short"
        );
    }

    fn band(up_to: usize, algorithm: Algorithm) -> crate::thresholds::Band {
        crate::thresholds::Band { up_to, algorithm }
    }

    #[test]
    fn zone_plans_fit_their_landing_zones() {
        for algo in [Algorithm::Push, Algorithm::PushLl, Algorithm::PushTwoStage] {
            // A table that runs `algo` up to 64 KiB, then one-stage.
            let mut t = Thresholds::default();
            t.set_bands(
                Link::NvLink,
                2,
                vec![band(64 << 10, algo), band(usize::MAX, Algorithm::OneStage)],
            )
            .expect("valid bands");
            let mut c = Config {
                thresholds: t,
                ..Config::default()
            };
            match algo {
                Algorithm::Push => c.push_max_bytes = 1024,
                Algorithm::PushLl => c.push_ll_max_bytes = 1024,
                _ => c.push_two_stage_max_bytes = 1024,
            }
            // Auto runs `algo` where it fits, the next band where not.
            let p = Plan::new(&c, request(256, Inputs::ZeroCopy, AlgoChoice::Auto)).expect("plan");
            assert_eq!(p.algorithm, algo);
            let p = Plan::new(&c, request(257, Inputs::ZeroCopy, AlgoChoice::Auto)).expect("plan");
            assert_eq!(p.algorithm, Algorithm::OneStage, "{algo:?}");
            // Explicit: refused zero-copy, chunked to the zone staged.
            assert!(matches!(
                Plan::new(&c, request(300, Inputs::ZeroCopy, AlgoChoice::from(algo))),
                Err(Error::ZoneTooSmall {
                    algorithm,
                    bytes: 1200,
                    capacity: 1024,
                    setting,
                }) if algorithm == algo && setting == zone_setting(algo)
            ));
            let p =
                Plan::new(&c, request(300, Inputs::Staged, AlgoChoice::from(algo))).expect("plan");
            let steps: Vec<(usize, usize)> = p.steps().map(|s| (s.offset, s.len)).collect();
            assert_eq!(steps, vec![(0, 256), (256, 44)]);
            assert!(p.steps().all(|s| s.entry.algorithm == algo));
            // Never on one device, by default.
            let same = Request {
                link: Link::SameDevice,
                ..request(16, Inputs::ZeroCopy, AlgoChoice::Auto)
            };
            assert_eq!(
                Plan::new(&c, same).expect("plan").algorithm,
                Algorithm::OneStage
            );
        }
    }

    #[test]
    fn blocks_stay_in_range() {
        for count in [0usize, 1, 7, 8, 4096, 1 << 20, 1 << 26] {
            for world in 1..=8 {
                for algo in Algorithm::ALL {
                    let b = blocks_for(algo, Dtype::Bf16, count, world, 512, 16);
                    assert!((1..=16).contains(&b), "{algo:?} {count} {world} -> {b}");
                }
            }
        }
        assert_eq!(
            blocks_for(Algorithm::OneStage, Dtype::F32, 4, 2, 512, 16),
            1
        );
        assert_eq!(
            blocks_for(Algorithm::OneStage, Dtype::F32, 4 * 512 * 3, 2, 512, 16),
            3
        );
    }
}
