//! `delivery = "auto"`: whether a CUDA consumer reads the producer's slot in place or
//! mirrors each batch into memory of its own (see [`crate::mirror`] for the figures).

use pipeline_core::Delivery;

/// Whether a consumer mirrors: `auto` mirrors on another GPU than the producer's, whatever
/// the slot size (a batch read over the link each time is slower than one copy, and the
/// producer's slot frees as soon as the copy is done).
pub fn mirrors(delivery: Delivery, on_producer_gpu: bool) -> bool {
    match delivery {
        Delivery::InPlace => false,
        Delivery::Mirror => true,
        Delivery::Auto => !on_producer_gpu,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_mirrors_on_another_gpu_only() {
        assert!(mirrors(Delivery::Auto, false));
        assert!(!mirrors(Delivery::Auto, true));
        assert!(mirrors(Delivery::Mirror, true));
        assert!(!mirrors(Delivery::InPlace, false));
    }
}
