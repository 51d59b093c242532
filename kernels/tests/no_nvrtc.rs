//! Without NVRTC: a library that is not there is a typed error naming what
//! was tried, on every machine (no GPU needed). Also a file that exists but
//! is not NVRTC.

use std::path::Path;

use qmk_kernels::{KernelsError, Nvrtc};

#[test]
fn missing_nvrtc_is_a_typed_error_naming_the_path() {
    let p = Path::new("/no/such/dir/libnvrtc.so.12");
    let e = Nvrtc::load_from(p).map(|_| ()).unwrap_err();
    assert!(matches!(e, KernelsError::NvrtcNotFound { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("/no/such/dir/libnvrtc.so.12"), "{msg}");
    assert!(msg.contains("QMK_NVRTC_LIB"), "{msg}");

    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("libnvrtc.so.12");
    std::fs::write(&fake, b"not a shared library").unwrap();
    let e = Nvrtc::load_from(&fake).map(|_| ()).unwrap_err();
    assert!(matches!(e, KernelsError::NvrtcNotFound { .. }), "{e:?}");
    assert!(e.to_string().contains(&*fake.to_string_lossy()), "{e}");
}
