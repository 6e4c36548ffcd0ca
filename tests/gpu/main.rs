//! The GPU suite: every kernel against the CPU reference, bit for bit.
//!
//! A `harness = false` test so that, on a machine without a CUDA driver
//! (CI), every case is reported as SKIPPED with the reason, and the summary
//! line says so, instead of counting as passed. On a GPU machine every case
//! runs; any failure exits non-zero. `GPU_PROPERTY_CASES` sets the number of
//! random property cases (default 1200).

mod comm;
mod faults;
mod fused;
mod fused_registered;
mod graphs;
mod groups;
mod harness;
mod mismatch;
mod numerics;
mod one_gpu;
mod processes;
mod routing;
mod shared_host;

use faults::{cross_host_refused, fault_matrix, killed_rank, stale_flags, timeout};
use fused::{fused_add_rmsnorm, fused_push_ll_clusters};
use fused_registered::{fused_auto_beyond_scratch, fused_registered};
use graphs::{capture_tracking_on, graph_replay, peer_group_graphs};
use groups::{api_safety, peer_group, push_changing_grids, push_ll_direct_inputs, user_errors};
use harness::{open_gpu, Gpu};
use numerics::{chunked, cross_algorithm, kernel_images, property, smoke, sweep};
use one_gpu::peer_one_gpu_issue31;
use processes::{ipc_child, ipc_processes};
use routing::thresholds_file;
#[cfg(feature = "nccl")]
use routing::{nccl_routed, nccl_table_routing};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

type Case = (&'static str, fn(&Gpu));

fn main() {
    let cases: &[Case] = &[
        ("smoke_sm_ptx_loads_and_runs", smoke),
        ("kernel_images_sass_and_jit_ptx_agree", kernel_images),
        ("sweep_dtypes_worlds_lengths_algorithms", sweep),
        ("property_random_cases", property),
        (
            "one_stage_equals_two_stage_and_length_independent",
            cross_algorithm,
        ),
        ("graph_replay_1000", graph_replay),
        ("chunked_large_message", chunked),
        ("peer_timeout_is_reported", timeout),
        (
            "stale_flags_are_no_arrival_2_31_collectives_on",
            stale_flags,
        ),
        (
            "ranks_that_disagree_injected_every_group_kind",
            mismatch::injected,
        ),
        ("ranks_that_disagree_two_processes", mismatch::processes),
        (
            "ranks_that_disagree_at_engine_shapes_two_processes",
            mismatch::engine_processes,
        ),
        ("user_errors_are_typed", user_errors),
        ("api_safety_misuse_is_refused_or_ordered", api_safety),
        ("peer_group_real_rank_entries_every_gpu", peer_group),
        ("peer_group_graph_replays", peer_group_graphs),
        ("push_back_to_back_with_changing_grids", push_changing_grids),
        ("push_ll_reads_inputs_in_place", push_ll_direct_inputs),
        ("thresholds_file_moves_auto", thresholds_file),
        ("fused_add_rmsnorm_bit_exact", fused_add_rmsnorm),
        ("fused_registered_zero_copy", fused_registered),
        ("fused_push_ll_split_over_clusters", fused_push_ll_clusters),
        ("ipc_process_group_every_gpu", ipc_processes),
        ("killed_rank_process_times_out_and_recovers", killed_rank),
        (
            "peer_group_one_gpu_crossed_buffers_fused_in_place_and_faults",
            peer_one_gpu_issue31,
        ),
        (
            "fused_auto_zero_copy_beyond_scratch_every_group_kind",
            fused_auto_beyond_scratch,
        ),
        ("capture_with_cudarc_event_tracking_on", capture_tracking_on),
        ("process_group_across_hosts_is_refused", cross_host_refused),
        ("fault_matrix_killed_rank_processes", fault_matrix),
        (
            "shared_host_forged_peer_buffers_two_processes",
            shared_host::processes,
        ),
        #[cfg(feature = "nccl")]
        ("nccl_group_and_routing_world_1", nccl_routed),
        #[cfg(feature = "nccl")]
        (
            "nccl_table_bands_route_auto_and_symmetric_windows",
            nccl_table_routing,
        ),
        ("comm_from_devices_eager_graph_unserved", comm::threads),
    ];
    if let Ok(rank) = std::env::var("P2P_IPC_CHILD") {
        std::process::exit(ipc_child(rank.parse().expect("P2P_IPC_CHILD is a rank")));
    }
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let selected: Vec<&Case> = cases
        .iter()
        .filter(|(n, _)| filter.is_empty() || filter.iter().any(|f| n.contains(f.as_str())))
        .collect();

    let gpu = match open_gpu() {
        Ok(g) => g,
        Err(reason) => {
            for (name, _) in &selected {
                println!("test {name} ... SKIPPED ({reason})");
            }
            println!("\ngpu suite skipped: {reason}");
            println!("gpu: 0 passed, 0 failed, {} skipped", selected.len());
            return;
        }
    };
    let (mut passed, mut failed) = (0, 0);
    for (name, f) in &selected {
        let t0 = Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| f(&gpu)));
        match r {
            Ok(()) => {
                passed += 1;
                println!("test {name} ... ok ({:.2} s)", t0.elapsed().as_secs_f64());
            }
            Err(e) => {
                failed += 1;
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
                println!("test {name} ... FAILED: {}", msg.unwrap_or_default());
            }
        }
    }
    println!("\ngpu: {passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}
