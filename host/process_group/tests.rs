//! Unit tests of the process group built on CPU-side exchanges.

use super::*;
use crate::exchange::InProcessExchange;
use std::time::Duration;

/// A step that fails on one rank ends every rank's setup with an error,
/// promptly, instead of leaving the others in the next exchange.
#[test]
fn one_rank_failing_a_setup_step_stops_every_rank() {
    let ranks = InProcessExchange::ranks(3, Duration::from_secs(5));
    let got: Vec<Result<u32>> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|ex| {
                s.spawn(move || {
                    let r = ex.rank();
                    let local = if r == 2 {
                        Err(Error::NoDriver)
                    } else {
                        Ok(r as u32)
                    };
                    agree_setup(ex, "kernels and buffers", local)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(matches!(got[2], Err(Error::NoDriver)), "{:?}", got[2]);
    for (r, g) in got.iter().enumerate().take(2) {
        match g {
            Err(Error::PeerSetupFailed {
                rank,
                peer: 2,
                step,
                reason,
            }) => {
                assert_eq!((*rank, *step), (r, "kernels and buffers"));
                assert!(reason.contains(&Error::NoDriver.to_string()), "{reason}");
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
    // And when every rank succeeds, each gets its own value.
    let ranks = InProcessExchange::ranks(2, Duration::from_secs(5));
    let got: Vec<u32> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|ex| s.spawn(move || agree_setup(ex, "x", Ok(ex.rank() as u32 + 10)).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, vec![10, 11]);
}
