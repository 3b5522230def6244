//! The backend interface's error for a driver failure: the one conversion the producer's and
//! the consumer's halves, the timelines (`sync`) and the mirror share.

use pipeline_core::BackendError;

use crate::driver::CudaError;

pub(crate) fn be(e: CudaError) -> BackendError {
    Box::new(e)
}
