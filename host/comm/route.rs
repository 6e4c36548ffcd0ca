//! Routing: which engine (the kernels or the NCCL fallback) serves a call,
//! and forming the NCCL fallback.

use super::*;

/// Why a call is not the kernels'.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Unserved {
    /// A reduction other than `Sum`.
    Op(ReduceOp),
    /// An element type without kernels.
    Type(&'static str),
    /// A size the group's `Auto` table gives to NCCL (issue 44: NCCL
    /// measured faster there, `thresholds::route`).
    Size,
}

/// Which engine runs an allreduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Engine {
    Kernels(Dtype),
    Nccl(Unserved),
}

/// Which engine serves an allreduce of `op` over `T`: **the one place
/// where a `Comm` routes its calls.** By what the kernels compute (a `Sum`
/// of f32, f16 or bf16; everything else is NCCL's), then, for what they
/// compute, by the group's `Auto` table: `nccl_wins(dtype)` says whether
/// the table gives this call's size to NCCL (issue 44,
/// `ProcessGroup::nccl_wins`, `PeerGroup::nccl_wins`). The caller passes
/// `nccl_wins` only where it holds an NCCL fallback: a size NCCL is faster
/// at is still the kernels' where there is none (they serve it, bit-exact,
/// only slower), unlike a call they cannot serve. (The fused
/// `all_reduce_add_rms_norm` has no NCCL form and is not routed.)
pub(super) fn route<T: CommElement>(op: ReduceOp, nccl_wins: impl FnOnce(Dtype) -> bool) -> Engine {
    match (op, T::KERNEL_DTYPE) {
        (ReduceOp::Sum, Some(dtype)) if nccl_wins(dtype) => Engine::Nccl(Unserved::Size),
        (ReduceOp::Sum, Some(dtype)) => Engine::Kernels(dtype),
        (ReduceOp::Sum, None) => Engine::Nccl(Unserved::Type(T::NAME)),
        (op, _) => Engine::Nccl(Unserved::Op(op)),
    }
}

/// `Error::CommUnserved` for a call of `op` over `T` that NCCL cannot take
/// because `why`.
pub(super) fn unserved<T: CommElement>(op: ReduceOp, why: String) -> Error {
    Error::CommUnserved {
        what: format!("ReduceOp::{op:?} over {}", T::NAME),
        why,
        fix: if cfg!(feature = "nccl") {
            "sum f32, f16 or bf16, or make the NCCL fallback available (libnccl on this machine, one GPU \
             per rank, CommOptions::nccl_fallback on)"
        } else {
            "sum f32, f16 or bf16, or build p2p-allreduce with its cargo feature `nccl` (libnccl is then \
             loaded at run time and takes these calls)"
        },
    }
}

/// `Error::CommUnserved` for a call that needs the NCCL fallback this
/// communicator does not have, because `why`.
#[cfg(feature = "nccl")]
pub(super) fn no_fallback<T: CommElement>(op: ReduceOp, why: &str) -> Error {
    unserved::<T>(op, format!("this communicator has no NCCL fallback: {why}"))
}

/// Why this build has no NCCL fallback.
#[cfg(not(feature = "nccl"))]
pub(super) const NO_NCCL: &str =
    "this build of p2p-allreduce has no NCCL fallback (its cargo feature `nccl` is off)";

/// An NCCL communicator, or why there is none.
#[cfg(feature = "nccl")]
pub(super) type Fallback<T> = std::result::Result<T, String>;

#[cfg(feature = "nccl")]
pub(super) fn nccl_op<T: CommElement>(op: ReduceOp) -> crate::nccl::NcclOp {
    crate::nccl::NcclOp {
        data_type: T::NCCL_TYPE,
        op: op.nccl_code(),
    }
}

/// The NCCL fallback of a `from_rank` rank: decided the same way on every
/// rank (one exchange round: can each load libnccl, and on which GPU),
/// then formed collectively. Libnccl missing on a rank or two ranks on one
/// GPU mean no fallback (said when a call needs it); an NCCL error while
/// forming it is returned.
#[cfg(feature = "nccl")]
pub(super) fn process_nccl(
    ctx: &Arc<CudaContext>,
    exchange: &DirExchange,
    wanted: bool,
) -> Result<Fallback<crate::nccl::NcclRank>> {
    use crate::exchange::Exchange as _;
    if !wanted {
        return Ok(Err("CommOptions::nccl_fallback is off".into()));
    }
    let mine = match (crate::nccl::library(), driver::pci_bus_id(ctx)) {
        (Ok(_), Ok(bus)) => format!("ok {bus}"),
        (Err(e), _) | (_, Err(e)) => format!("no {e}"),
    };
    let all = exchange.all_gather(mine.as_bytes())?;
    let said: Vec<String> = all
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    let mut buses: Vec<&str> = Vec::new();
    for (r, s) in said.iter().enumerate() {
        match s.strip_prefix("ok ") {
            Some(bus) => {
                if let Some(other) = buses.iter().position(|b| *b == bus) {
                    return Ok(Err(format!(
                        "ranks {other} and {r} share GPU {bus} (NCCL needs one GPU per rank)"
                    )));
                }
                buses.push(bus);
            }
            None => {
                let why = s.strip_prefix("no ").unwrap_or(s);
                return Ok(Err(format!("rank {r} cannot use NCCL: {why}")));
            }
        }
    }
    crate::nccl::NcclRank::new(ctx, exchange).map(Ok)
}

/// The NCCL fallback of `from_devices` ranks (one `ncclCommInitAll`), or
/// why there is none.
#[cfg(feature = "nccl")]
pub(super) fn thread_nccl(
    streams: &[Arc<CudaStream>],
    wanted: bool,
) -> Fallback<crate::nccl::NcclGroup> {
    if !wanted {
        return Err("CommOptions::nccl_fallback is off".into());
    }
    let devs: Vec<usize> = streams.iter().map(|s| s.context().ordinal()).collect();
    for (b, d) in devs.iter().enumerate() {
        if let Some(a) = devs[..b].iter().position(|x| x == d) {
            return Err(format!(
                "ranks {a} and {b} share GPU {d} (NCCL needs one GPU per rank)"
            ));
        }
    }
    crate::nccl::library().map_err(|e| e.to_string())?;
    crate::nccl::NcclGroup::new(streams).map_err(|e| e.to_string())
}
