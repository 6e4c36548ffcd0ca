//! The thread gather of `from_devices` communicators: each rank thread's call
//! meets the others' in one round, and mismatched calls fail on every rank.

use super::*;

/// One rank's part of a `from_devices` collective.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Call {
    AllReduce {
        dtype: Dtype,
        count: usize,
        input: u64,
        output: u64,
    },
    #[cfg(feature = "nccl")]
    Nccl {
        op: crate::nccl::NcclOp,
        count: usize,
        input: u64,
        output: u64,
    },
    AddRmsNorm {
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        eps_bits: u32,
        ptrs: [u64; 4],
    },
}

impl Call {
    /// The call without its pointers: what every rank must agree on.
    pub(super) fn shape(&self) -> String {
        match *self {
            Call::AllReduce { dtype, count, .. } => {
                format!("all_reduce of {count} x {}", dtype.name())
            }
            #[cfg(feature = "nccl")]
            Call::Nccl { op, count, .. } => format!(
                "all_reduce of {count} elements of NCCL type {} with NCCL op {} (the NCCL fallback)",
                op.data_type, op.op
            ),
            Call::AddRmsNorm {
                dtype,
                rows,
                hidden,
                eps_bits,
                ..
            } => format!(
                "all_reduce_add_rms_norm of {rows} rows x {hidden} {} (eps {})",
                dtype.name(),
                f32::from_bits(eps_bits)
            ),
        }
    }
}

/// What the ranks of a `from_devices` communicator share.
pub(super) struct Threads {
    pub(super) group: PeerGroup,
    pub(super) streams: Vec<Arc<CudaStream>>,
    pub(super) gather: Gather<Call>,
    #[cfg(feature = "nccl")]
    pub(super) nccl: Fallback<crate::nccl::NcclGroup>,
}

impl Threads {
    /// Enqueues every rank's part of one collective (`calls[r]`, rank r's),
    /// from rank `me`'s thread; one result per rank.
    pub(super) fn launch(&self, calls: &[Call], me: usize) -> Vec<Result<Route>> {
        if let Some(errors) = mismatch(calls) {
            return errors;
        }
        let ptrs = |f: fn(&Call) -> u64| -> Vec<u64> { calls.iter().map(f).collect() };
        let result = match calls[0] {
            Call::AllReduce { dtype, count, .. } => {
                let input = ptrs(|c| match *c {
                    Call::AllReduce { input, .. } => input,
                    _ => 0,
                });
                let output = ptrs(|c| match *c {
                    Call::AllReduce { output, .. } => output,
                    _ => 0,
                });
                // SAFETY: every rank's thread handed in pointers valid for
                // `count` elements of `dtype` on its device (Comm's
                // contract) and waits, holding their guards, until this
                // returns.
                unsafe {
                    self.group.allreduce_raw(
                        &self.streams,
                        dtype,
                        count,
                        &input,
                        &output,
                        AlgoChoice::Auto,
                    )
                }
                .map(Route::Kernel)
            }
            #[cfg(feature = "nccl")]
            Call::Nccl { op, count, .. } => {
                let input = ptrs(|c| match *c {
                    Call::Nccl { input, .. } => input,
                    _ => 0,
                });
                let output = ptrs(|c| match *c {
                    Call::Nccl { output, .. } => output,
                    _ => 0,
                });
                match (&self.nccl, self.group.poll()) {
                    (Err(why), _) => Err(Error::Nccl(format!("no NCCL fallback: {why}"))),
                    (_, Err(e)) => Err(e),
                    (Ok(n), Ok(())) => {
                        // SAFETY: as above, for `count` elements of op's type.
                        unsafe { n.allreduce_op_raw(&self.streams, op, count, &input, &output) }
                            .map(|()| Route::Nccl)
                    }
                }
            }
            Call::AddRmsNorm {
                dtype,
                rows,
                hidden,
                eps_bits,
                ..
            } => {
                let all: Vec<[u64; 4]> = calls
                    .iter()
                    .map(|c| match *c {
                        Call::AddRmsNorm { ptrs, .. } => ptrs,
                        _ => [0; 4],
                    })
                    .collect();
                // SAFETY: every rank's pointers hold what its norm_shape
                // checked, on its device, guarded by its waiting thread;
                // `normed` overlaps no other buffer of its rank, or is its
                // (staged) input.
                unsafe {
                    self.group.allreduce_add_rmsnorm_raw(
                        &self.streams,
                        dtype,
                        rows,
                        hidden,
                        f32::from_bits(eps_bits),
                        &all,
                        AlgoChoice::Auto,
                    )
                }
                .map(Route::Kernel)
            }
        };
        share(result, calls.len(), me)
    }
}

/// Where the ranks' calls differ (beyond their pointers), every rank's
/// `CommCallMismatch`: a rank that agrees with rank 0 is told of the first
/// rank that does not, the others of rank 0. `None` where all agree.
pub(super) fn mismatch(calls: &[Call]) -> Option<Vec<Result<Route>>> {
    let first = calls.first()?.shape();
    let other = calls.iter().position(|c| c.shape() != first)?;
    let other_shape = calls[other].shape();
    Some(
        calls
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let (o, mine, theirs) = if c.shape() == first {
                    (other, first.clone(), other_shape.clone())
                } else {
                    (0, c.shape(), first.clone())
                };
                Err(Error::CommCallMismatch {
                    rank: r,
                    other: o,
                    mine,
                    theirs,
                })
            })
            .collect(),
    )
}

/// One collective's result for every rank: rank `me` (who enqueued it)
/// gets the error itself, the others a typed account of it.
pub(super) fn share(result: Result<Route>, world: usize, me: usize) -> Vec<Result<Route>> {
    match result {
        Ok(route) => (0..world).map(|_| Ok(route)).collect(),
        Err(e) => {
            let other = |e: &Error| match e {
                // Each rank's own capture was refused alike: say so in the
                // same words, so each settles its stream the same way.
                Error::CaptureInvalidated { cause } => Error::CaptureInvalidated {
                    cause: cause.clone(),
                },
                e => Error::CommGroupCallFailed {
                    rank: me,
                    reason: e.to_string(),
                },
            };
            let mut out: Vec<Result<Route>> = (0..world).map(|_| Err(other(&e))).collect();
            out[me] = Err(e);
            out
        }
    }
}

/// The per-call meeting of a `from_devices` communicator's ranks: each
/// rank's thread leaves its call and waits; the last to come runs `launch`
/// over all the calls (in rank order) and hands every rank its result.
pub(super) struct Gather<C> {
    world: usize,
    timeout: Duration,
    pub(super) state: Mutex<Round<C>>,
    cv: Condvar,
}

pub(super) struct Round<C> {
    pub(super) calls: Vec<Option<C>>,
    results: Vec<Option<Result<Route>>>,
    /// Set when a rank gave up waiting: the ranks are out of step for good.
    broken: Option<String>,
}

impl<C: Copy> Gather<C> {
    pub(super) fn new(world: usize, timeout: Duration) -> Self {
        Gather {
            world,
            timeout,
            state: Mutex::new(Round {
                calls: vec![None; world],
                results: (0..world).map(|_| None).collect(),
                broken: None,
            }),
            cv: Condvar::new(),
        }
    }

    /// Rank `rank`'s part of one collective. `launch(calls, me)` runs on the
    /// thread of the last rank to come (`me`), with every rank's call, and
    /// returns one result per rank.
    pub(super) fn join(
        &self,
        rank: usize,
        call: C,
        launch: impl FnOnce(&[C], usize) -> Vec<Result<Route>>,
    ) -> Result<Route> {
        let deadline = Instant::now() + self.timeout;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &st.broken {
            return Err(Error::Poisoned(why.clone()));
        }
        if st.calls[rank].is_some() || st.results[rank].is_some() {
            return Err(Error::Config(format!(
                "rank {rank}'s Comm is already in a collective on another thread: make each rank's \
                 calls from one thread at a time"
            )));
        }
        st.calls[rank] = Some(call);
        if st.calls.iter().all(Option::is_some) {
            let calls: Vec<C> = st.calls.iter_mut().filter_map(Option::take).collect();
            let mut results = launch(&calls, rank);
            results.resize_with(self.world, || {
                Err(Error::CommGroupCallFailed {
                    rank,
                    reason: "no result for this rank".into(),
                })
            });
            let mine = std::mem::replace(&mut results[rank], Ok(Route::Nccl));
            for (r, res) in results.into_iter().enumerate() {
                if r != rank {
                    st.results[r] = Some(res);
                }
            }
            self.cv.notify_all();
            return mine;
        }
        loop {
            if let Some(res) = st.results[rank].take() {
                return res;
            }
            if let Some(why) = st.broken.clone() {
                st.calls[rank] = None;
                return Err(Error::Poisoned(why));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> =
                    (0..self.world).filter(|&r| st.calls[r].is_none()).collect();
                st.calls[rank] = None;
                st.broken = Some(format!(
                    "rank {rank} timed out after {:?} waiting for rank(s) {missing:?} to make the same call",
                    self.timeout
                ));
                self.cv.notify_all();
                return Err(Error::CommTimeout {
                    rank,
                    missing,
                    waited: self.timeout,
                });
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
