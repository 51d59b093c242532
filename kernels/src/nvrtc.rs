//! NVRTC, loaded at run time (no link-time CUDA dependency, works with no GPU).
//!
//! Search order: env `QMK_NVRTC_LIB` (a file), `libnvrtc.so.13`,
//! `libnvrtc.so.12`, `libnvrtc.so` (the loader's path), then the CUDA
//! toolkit (`/usr/local/cuda/lib64`) and the pip layout
//! (`nvidia/cuda_nvrtc/lib/libnvrtc.so.12` under the venv `.ci/nvrtc.sh`
//! makes, `~/.cache/qwen-mk/nvrtc-venv`).

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};

use crate::error::{KernelsError, Result};

type NvrtcResult = c_int;
type Program = *mut std::ffi::c_void;

type FnVersion = unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult;
type FnCreate = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> NvrtcResult;
type FnCompile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult;
type FnSize = unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult;
type FnGet = unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult;
type FnDestroy = unsafe extern "C" fn(*mut Program) -> NvrtcResult;
type FnErr = unsafe extern "C" fn(NvrtcResult) -> *const c_char;

/// A loaded NVRTC library.
pub struct Nvrtc {
    path: PathBuf,
    version: (i32, i32),
    create: FnCreate,
    compile: FnCompile,
    log_size: FnSize,
    log: FnGet,
    cubin_size: FnSize,
    cubin: FnGet,
    destroy: FnDestroy,
    err: FnErr,
    // Keeps the function pointers above valid.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

/// Output of one successful compilation.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The cubin image.
    pub cubin: Vec<u8>,
    /// NVRTC's log (with `--ptxas-options=-v`: registers, spills, smem).
    pub log: String,
}

fn home_cache() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/qwen-mk"))
}

/// Every place searched, in order.
pub fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("QMK_NVRTC_LIB") {
        out.push(PathBuf::from(p));
    }
    for n in ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"] {
        out.push(PathBuf::from(n));
    }
    for n in ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"] {
        out.push(Path::new("/usr/local/cuda/lib64").join(n));
    }
    if let Some(c) = home_cache() {
        let lib = c.join("nvrtc-venv/lib");
        if let Ok(rd) = std::fs::read_dir(&lib) {
            let mut pys: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
            pys.sort();
            for py in pys {
                out.push(py.join("site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"));
                out.push(py.join("site-packages/nvidia/cu13/lib/libnvrtc.so.13"));
            }
        }
    }
    out
}

impl Nvrtc {
    /// Loads the first NVRTC found (see the module docs for the order).
    pub fn load() -> Result<Nvrtc> {
        let mut tried = Vec::new();
        for c in candidates() {
            // A bare name goes to the dynamic loader; a path must exist.
            if c.components().count() > 1 && !c.exists() {
                tried.push(c.display().to_string());
                continue;
            }
            match Self::load_from(&c) {
                Ok(n) => return Ok(n),
                Err(_) => tried.push(c.display().to_string()),
            }
        }
        Err(KernelsError::NvrtcNotFound {
            tried: tried.join(", "),
        })
    }

    /// Loads NVRTC from one file or loader name.
    pub fn load_from(path: &Path) -> Result<Nvrtc> {
        // SAFETY: loading NVRTC runs its initialisers, which have no
        // preconditions.
        let lib = unsafe { libloading::Library::new(path.as_os_str()) }.map_err(|_| {
            KernelsError::NvrtcNotFound {
                tried: path.display().to_string(),
            }
        })?;
        fn sym<T: Copy>(lib: &libloading::Library, path: &Path, name: &'static str) -> Result<T> {
            // SAFETY: T is the documented signature of the NVRTC symbol.
            unsafe { lib.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|source| KernelsError::NvrtcSymbol {
                    path: path.to_path_buf(),
                    symbol: name,
                    source,
                })
        }
        let version: FnVersion = sym(&lib, path, "nvrtcVersion")?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        let code = unsafe { version(&mut major, &mut minor) };
        if code != 0 {
            return Err(KernelsError::NvrtcCall {
                call: "nvrtcVersion",
                code,
                message: String::new(),
            });
        }
        Ok(Nvrtc {
            path: path.to_path_buf(),
            version: (major, minor),
            create: sym(&lib, path, "nvrtcCreateProgram")?,
            compile: sym(&lib, path, "nvrtcCompileProgram")?,
            log_size: sym(&lib, path, "nvrtcGetProgramLogSize")?,
            log: sym(&lib, path, "nvrtcGetProgramLog")?,
            cubin_size: sym(&lib, path, "nvrtcGetCUBINSize")?,
            cubin: sym(&lib, path, "nvrtcGetCUBIN")?,
            destroy: sym(&lib, path, "nvrtcDestroyProgram")?,
            err: sym(&lib, path, "nvrtcGetErrorString")?,
            _lib: lib,
        })
    }

    /// The library file or loader name it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// (major, minor), e.g. (12, 9).
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    fn message(&self, code: NvrtcResult) -> String {
        // SAFETY: nvrtcGetErrorString returns a static C string.
        let p = unsafe { (self.err)(code) };
        if p.is_null() {
            return format!("NVRTC error {code}");
        }
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn check(&self, call: &'static str, code: NvrtcResult) -> Result<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(KernelsError::NvrtcCall {
                call,
                code,
                message: self.message(code),
            })
        }
    }

    /// Compiles `source` (named `name`) with in-memory `headers` (include
    /// name, text) to a cubin. `arch` only labels errors; the options carry
    /// `--gpu-architecture`.
    pub fn compile(
        &self,
        name: &str,
        source: &str,
        headers: &[(&str, &str)],
        options: &[String],
        arch: &str,
    ) -> Result<Compiled> {
        let cstr = |s: &str, what: &'static str| {
            CString::new(s).map_err(|_| KernelsError::NvrtcCall {
                call: what,
                code: -1,
                message: format!("{what} contains a NUL byte"),
            })
        };
        let src = cstr(source, "kernel source")?;
        let cname = cstr(name, "kernel name")?;
        let htexts = headers
            .iter()
            .map(|(_, t)| cstr(t, "header text"))
            .collect::<Result<Vec<_>>>()?;
        let hnames = headers
            .iter()
            .map(|(n, _)| cstr(n, "header name"))
            .collect::<Result<Vec<_>>>()?;
        let opts = options
            .iter()
            .map(|o| cstr(o, "option"))
            .collect::<Result<Vec<_>>>()?;
        let hp: Vec<*const c_char> = htexts.iter().map(|c| c.as_ptr()).collect();
        let np: Vec<*const c_char> = hnames.iter().map(|c| c.as_ptr()).collect();
        let op: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: all pointers are valid NUL-terminated strings that outlive
        // the call; the arrays have the counts given.
        let code = unsafe {
            (self.create)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                hp.len() as c_int,
                hp.as_ptr(),
                np.as_ptr(),
            )
        };
        self.check("nvrtcCreateProgram", code)?;
        let result = self.compile_program(prog, &op, arch);
        // SAFETY: prog came from nvrtcCreateProgram and is destroyed once.
        unsafe { (self.destroy)(&mut prog) };
        result
    }

    fn compile_program(&self, prog: Program, op: &[*const c_char], arch: &str) -> Result<Compiled> {
        // SAFETY: prog is live; op holds op.len() valid C strings.
        let code = unsafe { (self.compile)(prog, op.len() as c_int, op.as_ptr()) };
        let mut n = 0usize;
        // SAFETY: prog is live; out-pointers valid; buffer sized by NVRTC.
        self.check("nvrtcGetProgramLogSize", unsafe {
            (self.log_size)(prog, &mut n)
        })?;
        let mut buf = vec![0u8; n.max(1)];
        self.check("nvrtcGetProgramLog", unsafe {
            (self.log)(prog, buf.as_mut_ptr().cast())
        })?;
        let log = String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .to_string();
        if code != 0 {
            return Err(KernelsError::Compile {
                arch: arch.to_string(),
                log: format!("{}\n{log}", self.message(code)),
            });
        }
        let mut size = 0usize;
        self.check("nvrtcGetCUBINSize", unsafe {
            (self.cubin_size)(prog, &mut size)
        })?;
        let mut cubin = vec![0u8; size];
        self.check("nvrtcGetCUBIN", unsafe {
            (self.cubin)(prog, cubin.as_mut_ptr().cast())
        })?;
        Ok(Compiled { cubin, log })
    }
}
