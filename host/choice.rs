//! The words a caller uses to pick an algorithm: what it asks for
//! ([`AlgoChoice`]) and how the ranks reach each other ([`Link`]). Both
//! the settings ([`crate::config`], which re-exports them) and `Auto`'s
//! table ([`crate::thresholds`]) use them, so neither imports the other's
//! words: config imports thresholds, never the other way.

use crate::abi::Algorithm;

/// What the caller asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AlgoChoice {
    /// By the [`Thresholds`](crate::thresholds::Thresholds) for this world
    /// size and link (built in, or measured by `p2p-allreduce tune`).
    #[default]
    Auto,
    OneStage,
    TwoStage,
    /// Needs the message to fit `Config::push_max_bytes` (staged calls are
    /// chunked to it).
    Push,
    /// Push with flag-in-data lines (one one-way trip, twice the bytes).
    /// Needs the message to fit `Config::push_ll_max_bytes` (staged calls
    /// are chunked to it).
    PushLl,
    /// Reduce-scatter and all-gather by writes into landing zones. Needs
    /// the message to fit `Config::push_two_stage_max_bytes` (staged calls
    /// are chunked to it).
    PushTwoStage,
    /// Push two-stage over two islands of ranks (the first half of the
    /// ranks and the rest, e.g. two PCIe switches), only partial sums and
    /// results crossing between them. Needs the message to fit
    /// `Config::push_two_stage_max_bytes` too (staged calls are chunked to
    /// it).
    PushIslands,
}

impl AlgoChoice {
    /// The algorithm asked for, or `None` for `Auto`.
    pub fn explicit(self) -> Option<Algorithm> {
        match self {
            AlgoChoice::Auto => None,
            AlgoChoice::OneStage => Some(Algorithm::OneStage),
            AlgoChoice::TwoStage => Some(Algorithm::TwoStage),
            AlgoChoice::Push => Some(Algorithm::Push),
            AlgoChoice::PushLl => Some(Algorithm::PushLl),
            AlgoChoice::PushTwoStage => Some(Algorithm::PushTwoStage),
            AlgoChoice::PushIslands => Some(Algorithm::PushIslands),
        }
    }
}

impl From<Algorithm> for AlgoChoice {
    fn from(a: Algorithm) -> Self {
        match a {
            Algorithm::OneStage => AlgoChoice::OneStage,
            Algorithm::TwoStage => AlgoChoice::TwoStage,
            Algorithm::Push => AlgoChoice::Push,
            Algorithm::PushLl => AlgoChoice::PushLl,
            Algorithm::PushTwoStage => AlgoChoice::PushTwoStage,
            Algorithm::PushIslands => AlgoChoice::PushIslands,
        }
    }
}

/// How the ranks reach each other's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// Virtual ranks, or several ranks on one GPU.
    SameDevice,
    NvLink,
    Pcie,
}
