//! Page-locking host memory read-only (`HostRegistration::read_only`, what gpipe-py's
//! `pin_memory` does to a host ring's slots): a read-only mapping can be locked, a copy from
//! it to the GPU is right, and the calling thread's current context is the same before the
//! lock, after it and after its drop (the thread may be a Python caller's, whose current
//! context is torch's device).

use std::time::Duration;

use cudarc::driver::sys;
use pipeline_cuda::driver::{
    Context, DeviceBuffer, HostRegistration, SavedContext, Stream, current_device,
    memcpy_dtoh_async, memcpy_htod_async,
};

const LEN: usize = 4 << 20;

fn current() -> sys::CUcontext {
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the driver is initialised (a context was made first); the out-pointer is a
    // valid local.
    let r = unsafe { sys::cuCtxGetCurrent(&mut c) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    c
}

fn set_current(c: sys::CUcontext) {
    // SAFETY: `c` is null or a context this test retained and still holds.
    let r = unsafe { sys::cuCtxSetCurrent(c) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_read_only_mapping_is_locked_and_copied_from_and_the_current_context_is_kept() {
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(60));
        eprintln!("host_registration test: still running after 60 s; giving up");
        std::process::exit(2);
    });
    let ctx = Context::new(0).unwrap();
    let mut map = memmap2::MmapMut::map_anon(LEN).unwrap();
    for (i, b) in map.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let map = map.make_read_only().unwrap(); // PROT_READ, as a consumer maps its slots

    // No current context: the lock leaves none, and so does its drop.
    set_current(std::ptr::null_mut());
    assert_eq!(current_device().unwrap(), None);
    // SAFETY: `map` stays mapped until after `lock` is dropped below.
    let lock = unsafe { HostRegistration::read_only(&ctx, map.as_ptr(), LEN) }.unwrap();
    assert!(current().is_null(), "the lock left a context current");

    // The copy from the locked memory is right.
    ctx.make_current().unwrap();
    assert_eq!(current_device().unwrap(), Some(0));
    let stream = Stream::new(&ctx).unwrap();
    let dev = DeviceBuffer::new(&ctx, LEN).unwrap();
    let mut back = vec![0u8; LEN];
    // SAFETY: `dev` holds LEN bytes that nothing else uses; `map` and `back` hold LEN bytes
    // and stay untouched until the stream is synchronised.
    unsafe {
        memcpy_htod_async(dev.ptr(), map.as_ptr(), LEN, &stream).unwrap();
        memcpy_dtoh_async(back.as_mut_ptr(), dev.ptr(), LEN, &stream).unwrap();
    }
    stream.synchronize().unwrap();
    assert!(
        back[..] == map[..],
        "the copy from the locked memory differs"
    );

    set_current(std::ptr::null_mut());
    drop(lock);
    assert!(current().is_null(), "the unlock left a context current");
    ctx.make_current().unwrap();
    let ours = current();
    drop(SavedContext::save().unwrap());
    assert_eq!(current(), ours, "a saved context was not put back");
}
