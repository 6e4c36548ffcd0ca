//! What a group learns from the machine it runs on before it plans: the
//! table `Auto` uses for this GPU model, GPU count, link and world.
//!
//! The table itself ([`crate::thresholds`]) is data and pure functions;
//! this module asks the driver which GPUs there are and picks the entry,
//! so it sits above both (docs/architecture.md, "Layers").

use crate::choice::Link;
use crate::driver;
use crate::error::Result;
use crate::thresholds::{self, Origin, Thresholds};
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// The table a group of `world` ranks over `link` on `ctx`'s device uses:
/// `thresholds` itself if the caller set it, else
/// [`thresholds::for_machine`] for this device's model and GPU count.
pub(crate) fn resolve_thresholds(
    thresholds: &Thresholds,
    ctx: &Arc<CudaContext>,
    link: Link,
    world: usize,
) -> Result<Thresholds> {
    if *thresholds.origin() != Origin::BuiltIn {
        return Ok(thresholds.clone());
    }
    let gpu = driver::device_info(ctx)?.name;
    let gpus = driver::device_count()?;
    thresholds::for_machine(&gpu, gpus, link, world)
}
