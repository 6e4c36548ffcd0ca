//! `--procs`: one process per GPU, as serving engines run. The command
//! starts itself once per rank with the same arguments and these variables
//! set; the ranks meet through a [`DirExchange`] in a fresh private
//! directory (random name, mode 0700) and form a `ProcessGroup` over CUDA IPC.
//!
//! Rank 0 prints to this terminal as it goes; the other ranks' output is
//! collected and shown when they end. A rank still running after the
//! deadline is killed, never waited on forever.

use p2p_allreduce::DirExchange;
use std::io::Read as _;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

const ENV_RANK: &str = "P2P_ALLREDUCE_PROC_RANK";
const ENV_WORLD: &str = "P2P_ALLREDUCE_PROC_WORLD";
const ENV_GPU: &str = "P2P_ALLREDUCE_PROC_GPU";
const ENV_DIR: &str = "P2P_ALLREDUCE_PROC_DIR";

/// How long ranks wait for each other at the rendezvous.
pub const RENDEZVOUS: Duration = Duration::from_secs(120);

/// What a rank process was started with.
#[derive(Clone, Debug)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    pub gpu: usize,
    pub dir: std::path::PathBuf,
}

impl RankEnv {
    /// Set in a rank process, `None` in the command the user started.
    pub fn get() -> Option<RankEnv> {
        let var = |k: &str| std::env::var(k).ok();
        Some(RankEnv {
            rank: var(ENV_RANK)?.parse().ok()?,
            world: var(ENV_WORLD)?.parse().ok()?,
            gpu: var(ENV_GPU)?.parse().ok()?,
            dir: var(ENV_DIR)?.into(),
        })
    }

    pub fn exchange(&self) -> p2p_allreduce::Result<DirExchange> {
        DirExchange::new(&self.dir, self.rank, self.world, RENDEZVOUS)
    }
}

/// Starts one rank per entry of `gpus` (this executable, same arguments),
/// waits at most `deadline` for all, and returns success only if every rank
/// succeeded. Exit code 2 (nothing ran) when every rank said so.
pub fn run_ranks(what: &str, gpus: &[usize], deadline: Duration) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("{what}: cannot find this executable to start the ranks: {e}");
            return ExitCode::FAILURE;
        }
    };
    // A private directory (mode 0700) of an unguessable name, made here:
    // never one another user could have made in advance. Removed when the
    // run ends.
    let prefix = format!("p2p-allreduce-{what}-");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o700));
    }
    let tmp = match builder.tempdir() {
        Ok(t) => t,
        Err(e) => {
            eprintln!(
                "{what}: cannot create the ranks' rendezvous directory in {}: {e}",
                std::env::temp_dir().display()
            );
            return ExitCode::FAILURE;
        }
    };
    let dir = tmp.path().to_path_buf();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut children = Vec::new();
    for (rank, &gpu) in gpus.iter().enumerate() {
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .env(ENV_RANK, rank.to_string())
            .env(ENV_WORLD, gpus.len().to_string())
            .env(ENV_GPU, gpu.to_string())
            .env(ENV_DIR, &dir)
            .stdin(Stdio::null());
        if rank != 0 {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        match cmd.spawn() {
            Ok(mut c) => {
                // Drained while the rank runs, so a full pipe never blocks it.
                let readers: Vec<_> = [
                    c.stdout
                        .take()
                        .map(|o| Box::new(o) as Box<dyn std::io::Read + Send>),
                    c.stderr
                        .take()
                        .map(|e| Box::new(e) as Box<dyn std::io::Read + Send>),
                ]
                .into_iter()
                .flatten()
                .map(|mut r| {
                    std::thread::spawn(move || {
                        let mut s = String::new();
                        let _ = r.read_to_string(&mut s);
                        s
                    })
                })
                .collect();
                children.push((rank, c, readers))
            }
            Err(e) => {
                eprintln!("{what}: cannot start rank {rank}: {e}");
                for (_, mut c, _) in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return ExitCode::FAILURE;
            }
        }
    }
    let t0 = Instant::now();
    let mut codes = Vec::new();
    for (rank, mut c, readers) in children {
        let status = loop {
            match c.try_wait() {
                Ok(Some(st)) => break Some(st),
                Ok(None) if t0.elapsed() > deadline => {
                    let _ = c.kill();
                    let _ = c.wait();
                    break None;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(_) => break None,
            }
        };
        let text: String = readers
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect();
        if rank != 0 {
            for line in text.lines() {
                println!("[rank {rank}] {line}");
            }
        }
        match status {
            Some(st) => codes.push(st.code()),
            None => {
                println!("{what}: rank {rank} did not finish within {deadline:?}: killed");
                codes.push(None);
            }
        }
    }
    if let Err(e) = tmp.close() {
        eprintln!("{what}: cannot remove {}: {e}", dir.display());
    }
    if codes.iter().all(|c| *c == Some(0)) {
        ExitCode::SUCCESS
    } else if codes
        .iter()
        .all(|c| *c == Some(i32::from(crate::NOTHING_RAN)))
    {
        ExitCode::from(crate::NOTHING_RAN)
    } else {
        println!("{what}: rank exit codes {codes:?}");
        ExitCode::FAILURE
    }
}

/// What a rank process works with once it has joined its group.
pub struct Joined {
    pub ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    pub stream: std::sync::Arc<cudarc::driver::CudaStream>,
    pub exchange: DirExchange,
    pub group: p2p_allreduce::ProcessGroup,
}

/// Opens this rank's GPU, makes a stream, joins the rendezvous and forms
/// the ProcessGroup with `config`; or prints why not (as `what`) and
/// returns the exit code. `graphs`: the caller captures graphs, so cudarc's
/// event tracking (which capture cannot record) is turned off.
pub fn join(
    what: &str,
    env: &RankEnv,
    config: p2p_allreduce::Config,
    graphs: bool,
) -> Result<Joined, ExitCode> {
    let ctx = crate::open_gpu(what, env.gpu)?;
    if graphs {
        // SAFETY: every buffer of a rank process is used on its one stream
        // only, so cudarc's cross-stream tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
    }
    let fail = |step: &str, e: &dyn std::fmt::Display| {
        println!(
            "{what}: rank {} on GPU {}: cannot {step}: {e}",
            env.rank, env.gpu
        );
        ExitCode::FAILURE
    };
    let stream = ctx.new_stream().map_err(|e| fail("create a stream", &e))?;
    let exchange = env
        .exchange()
        .map_err(|e| fail("join the rendezvous", &e))?;
    let group = p2p_allreduce::ProcessGroup::new(&ctx, &exchange, config)
        .map_err(|e| fail("form the ProcessGroup", &e))?;
    Ok(Joined {
        ctx,
        stream,
        exchange,
        group,
    })
}

/// The GPUs of a `--procs` run: those listed, else every visible GPU.
pub fn gpus_or_all(listed: &[usize]) -> Vec<usize> {
    if !listed.is_empty() {
        return listed.to_vec();
    }
    (0..crate::gpu_count()).collect()
}
