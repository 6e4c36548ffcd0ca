//! CPU reference allreduce (the oracle). Being written.
