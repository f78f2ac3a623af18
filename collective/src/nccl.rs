//! NCCL, for tensors in GPU memory: the collectives run where the tensors are, with no copy to
//! the host and back.
//!
//! The library is the one PyTorch's CUDA wheel already ships (`nvidia-nccl-cu12` / `-cu13`),
//! opened at run time rather than linked: a build without a GPU, or without CUDA at all, is the
//! same build, and [`probe`] says why NCCL cannot be used where it cannot. In a process that has
//! libtorch's CUDA part loaded (a PyTorch program, `hora-client`), NCCL and the CUDA runtime are
//! loaded already and are found by name; `HORA_NCCL_LIBRARY` and `HORA_CUDART_LIBRARY` name
//! others.
//!
//! An NCCL communicator is formed over a Hora ring ([`Communicator::use_nccl`]): first every rank
//! says over the ring, whose neighbours proved they belong to the world, whether it can use NCCL
//! and on which GPU (its host and PCI bus id), so every rank learns whether every other can
//! before any of them starts to: a rank that cannot, or two ranks on one GPU (which NCCL
//! refuses), are named with the reason on every rank. Only then does rank 0 make the NCCL id and
//! the ring carry it to the others, and each rank joins the communicator, within the ring's
//! timeout (a rank lost meanwhile ends the formation with an error, not a hang). Each collective
//! is then agreed on over the ring first (the call, its element count and type, a fingerprint of
//! the tensors): ranks that disagree fail with an error that says how, instead of NCCL reducing
//! mismatched buffers or waiting forever. The operation itself is enqueued on the caller's CUDA
//! stream (PyTorch's current stream, so it is ordered with the caller's kernels) and waited for
//! under a watchdog: a rank that died or stalled mid-collective (or while NCCL connects) ends it
//! with an error after the ring's timeout (the communicator is aborted, which frees the GPU),
//! rather than a hang. A failure the ring sees (a lost neighbour, a mismatch) aborts it too.
//!
//! Half-precision tensors (float16, bfloat16) are summed by NCCL in their own precision, as
//! `torch.distributed` does; the ring on host memory sums them in f32.
//!
//! [`Communicator::use_nccl`]: crate::Communicator::use_nccl

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use libloading::Library;

use crate::ring::Reduce;
use crate::{CollectiveError, Result};

/// An element type NCCL reduces itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F16,
    BF16,
    F32,
    F64,
}

impl DType {
    /// NCCL's `ncclDataType_t`.
    pub(crate) fn code(self) -> c_int {
        match self {
            DType::F16 => 6,
            DType::F32 => 7,
            DType::F64 => 8,
            DType::BF16 => 9,
        }
    }

    /// Bytes per element.
    pub fn width(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }

    /// From PyTorch's name (`torch.float32`, `float32`, `float`, `half`, `bfloat16`, …).
    pub fn parse(name: &str) -> Option<DType> {
        match name.strip_prefix("torch.").unwrap_or(name) {
            "float16" | "half" => Some(DType::F16),
            "bfloat16" => Some(DType::BF16),
            "float32" | "float" => Some(DType::F32),
            "float64" | "double" => Some(DType::F64),
            _ => None,
        }
    }
}

/// `count` elements of `dtype` in GPU memory at `ptr`, on the communicator's device.
#[derive(Debug, Clone, Copy)]
pub struct DeviceBuffer {
    pub ptr: *mut c_void,
    pub count: usize,
    pub dtype: DType,
}

// SAFETY: a device address is a number to this process: it is only dereferenced by NCCL's
// kernels on the GPU.
unsafe impl Send for DeviceBuffer {}

type CommHandle = *mut c_void;

/// A communicator handle that crosses to the threads that form and watch it.
#[derive(Clone, Copy)]
struct Handle(CommHandle);

// SAFETY: an NCCL communicator handle may be used from any thread; NCCL documents
// `ncclCommAbort` from another thread as the way to end a stuck operation.
unsafe impl Send for Handle {}
/// A `cudaStream_t`; null is the device's default stream.
pub type Stream = *mut c_void;

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId([u8; 128]);

const NCCL_SUCCESS: c_int = 0;
/// `ncclSystemError` and `ncclRemoteError`: a connection to another rank broke.
const NCCL_SYSTEM_ERROR: c_int = 2;
const NCCL_REMOTE_ERROR: c_int = 6;
const NCCL_IN_PROGRESS: c_int = 7;
const CUDA_SUCCESS: c_int = 0;
const CUDA_NOT_READY: c_int = 600;
/// Operations per NCCL group (NCCL takes at most 2048 in one).
const GROUP: usize = 1024;
const NCCL_SUM: c_int = 0;
const NCCL_AVG: c_int = 4;

/// `ncclAllReduce` and `ncclBroadcast`: buffers, count, type, the op or the root, the
/// communicator and the stream.
type Collective = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    CommHandle,
    Stream,
) -> c_int;

/// The functions Hora calls, with the libraries that hold them (kept open while they are used).
struct Api {
    version: String,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut CommHandle, c_int, UniqueId, c_int) -> c_int,
    /// `ncclAllReduce(send, recv, count, datatype, op, comm, stream)`.
    all_reduce: Collective,
    /// `ncclBroadcast(send, recv, count, datatype, root, comm, stream)`.
    broadcast: Collective,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    comm_destroy: unsafe extern "C" fn(CommHandle) -> c_int,
    comm_abort: unsafe extern "C" fn(CommHandle) -> c_int,
    async_error: unsafe extern "C" fn(CommHandle, *mut c_int) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    device_count: unsafe extern "C" fn(*mut c_int) -> c_int,
    set_device: unsafe extern "C" fn(c_int) -> c_int,
    stream_query: unsafe extern "C" fn(Stream) -> c_int,
    pci_bus_id: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int,
    cuda_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    _nccl: Library,
    _cudart: Library,
}

/// The first of `names` this process has loaded already (PyTorch's own, so a cu12 process never
/// loads a second CUDA runtime), else the first of them that opens.
fn open(what: &str, names: &[String]) -> std::result::Result<Library, String> {
    for name in names {
        // SAFETY: RTLD_NOLOAD opens nothing new: it finds a library loaded already.
        let loaded = unsafe {
            libloading::os::unix::Library::open(Some(name), libc::RTLD_NOLOAD | libc::RTLD_NOW)
        };
        if let Ok(lib) = loaded {
            return Ok(lib.into());
        }
    }
    let mut tried = Vec::new();
    for name in names {
        // SAFETY: NCCL's and the CUDA runtime's initialisers set up their own state only.
        match unsafe { Library::new(name) } {
            Ok(lib) => return Ok(lib),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(format!("{what} could not be loaded ({})", tried.join("; ")))
}

/// `override_var`'s value if set, then `defaults`.
fn candidates(override_var: &str, defaults: &[&str]) -> Vec<String> {
    std::env::var(override_var)
        .ok()
        .filter(|v| !v.is_empty())
        .into_iter()
        .chain(defaults.iter().map(|s| s.to_string()))
        .collect()
}

macro_rules! symbol {
    ($lib:expr, $name:literal) => {
        // SAFETY: the type is the function's declaration in NCCL's `nccl.h` (or the CUDA
        // runtime's `cuda_runtime_api.h`); the library stays open as long as the `Api` holding
        // the pointer.
        *unsafe { $lib.get($name) }.map_err(|e| {
            format!(
                "{} is missing from the library ({e}): NCCL 2.10 or later is needed",
                String::from_utf8_lossy(&$name[..$name.len() - 1])
            )
        })?
    };
}

impl Api {
    fn load() -> std::result::Result<Api, String> {
        let nccl = open(
            "NCCL",
            &candidates("HORA_NCCL_LIBRARY", &["libnccl.so.2", "libnccl.so"]),
        )?;
        let cudart = open(
            "the CUDA runtime",
            &candidates(
                "HORA_CUDART_LIBRARY",
                &["libcudart.so.13", "libcudart.so.12", "libcudart.so"],
            ),
        )?;
        let get_version: unsafe extern "C" fn(*mut c_int) -> c_int =
            symbol!(nccl, b"ncclGetVersion\0");
        let mut code: c_int = 0;
        // SAFETY: ncclGetVersion writes one int.
        if unsafe { get_version(&mut code) } != NCCL_SUCCESS {
            return Err("ncclGetVersion failed".into());
        }
        // NCCL_VERSION_CODE: major × 10000 + minor × 100 + patch (since 2.9).
        let (major, minor, patch) = (code / 10000, code / 100 % 100, code % 100);
        if (major, minor) < (2, 10) {
            return Err(format!(
                "NCCL {major}.{minor}.{patch} is too old: 2.10 or later is needed (for averaging)"
            ));
        }
        Ok(Api {
            version: format!("{major}.{minor}.{patch}"),
            get_unique_id: symbol!(nccl, b"ncclGetUniqueId\0"),
            comm_init_rank: symbol!(nccl, b"ncclCommInitRank\0"),
            all_reduce: symbol!(nccl, b"ncclAllReduce\0"),
            broadcast: symbol!(nccl, b"ncclBroadcast\0"),
            group_start: symbol!(nccl, b"ncclGroupStart\0"),
            group_end: symbol!(nccl, b"ncclGroupEnd\0"),
            comm_destroy: symbol!(nccl, b"ncclCommDestroy\0"),
            comm_abort: symbol!(nccl, b"ncclCommAbort\0"),
            async_error: symbol!(nccl, b"ncclCommGetAsyncError\0"),
            error_string: symbol!(nccl, b"ncclGetErrorString\0"),
            device_count: symbol!(cudart, b"cudaGetDeviceCount\0"),
            set_device: symbol!(cudart, b"cudaSetDevice\0"),
            stream_query: symbol!(cudart, b"cudaStreamQuery\0"),
            pci_bus_id: symbol!(cudart, b"cudaDeviceGetPCIBusId\0"),
            cuda_error_string: symbol!(cudart, b"cudaGetErrorString\0"),
            _nccl: nccl,
            _cudart: cudart,
        })
    }

    fn nccl_error(&self, code: c_int) -> String {
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let s = unsafe { (self.error_string)(code) };
        describe(s, code)
    }

    fn cuda_error(&self, code: c_int) -> String {
        // SAFETY: cudaGetErrorString returns a static string for any code.
        let s = unsafe { (self.cuda_error_string)(code) };
        describe(s, code)
    }

    /// A broken connection to another rank is [`CollectiveError::NcclStalled`] (an elastic job
    /// survives it); any other failure [`CollectiveError::Nccl`].
    fn nccl(&self, what: &str, code: c_int) -> Result<()> {
        let why = || format!("{what} failed: {}", self.nccl_error(code));
        match code {
            NCCL_SUCCESS => Ok(()),
            NCCL_SYSTEM_ERROR | NCCL_REMOTE_ERROR => Err(CollectiveError::NcclStalled(format!(
                "{}: a rank died or its connection broke",
                why()
            ))),
            _ => Err(CollectiveError::Nccl(why())),
        }
    }

    fn cuda(&self, what: &str, code: c_int) -> Result<()> {
        match code {
            CUDA_SUCCESS => Ok(()),
            code => Err(CollectiveError::Nccl(format!(
                "{what} failed: {}",
                self.cuda_error(code)
            ))),
        }
    }
}

fn describe(s: *const c_char, code: c_int) -> String {
    match s.is_null() {
        true => format!("error {code}"),
        // SAFETY: a non-null pointer from the libraries' error-string functions is a static
        // NUL-terminated string.
        false => format!(
            "{} (error {code})",
            unsafe { CStr::from_ptr(s) }.to_string_lossy()
        ),
    }
}

/// The libraries, loaded once per process.
fn api() -> std::result::Result<Arc<Api>, String> {
    static API: OnceLock<std::result::Result<Arc<Api>, String>> = OnceLock::new();
    API.get_or_init(|| Api::load().map(Arc::new)).clone()
}

/// What this process can use NCCL with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// NCCL's version, `2.27.5`.
    pub version: String,
    /// The CUDA devices this process sees.
    pub devices: u32,
}

/// Whether this process can run NCCL collectives, and if not, why (no library, no driver, no
/// device), in words an operator can act on.
pub fn probe() -> std::result::Result<Probe, String> {
    let api = api()?;
    let mut n: c_int = 0;
    // SAFETY: cudaGetDeviceCount writes one int.
    let code = unsafe { (api.device_count)(&mut n) };
    match (code, n) {
        (CUDA_SUCCESS, n) if n > 0 => Ok(Probe {
            version: api.version.clone(),
            devices: n as u32,
        }),
        (CUDA_SUCCESS, _) => Err(format!(
            "NCCL {} is here, but no CUDA device is visible (check CUDA_VISIBLE_DEVICES)",
            api.version
        )),
        (code, _) => Err(format!(
            "NCCL {} is here, but no CUDA device can be used: {}",
            api.version,
            api.cuda_error(code)
        )),
    }
}

/// NCCL's version, if the library loads (whether or not there is a GPU).
pub fn version() -> std::result::Result<String, String> {
    api().map(|api| api.version.clone())
}

/// What a rank asks for when a world forms NCCL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Its NCCL is turned off (`--nccl off`, `nccl="off"`).
    Off,
    /// Its tensors are on the CPU.
    Cpu,
    /// NCCL on this CUDA device.
    Cuda(i32),
}

/// What one rank brings to the formation of an NCCL communicator (see
/// [`Communicator::use_nccl`](crate::Communicator::use_nccl)): the GPU it would use (its host
/// and PCI bus id), or why it cannot.
pub(crate) struct Offer(std::result::Result<String, String>);

impl Offer {
    pub(crate) fn new(want: Want) -> Offer {
        Offer(match want {
            Want::Off => Err("its NCCL is turned off (--nccl off; nccl=\"off\")".into()),
            Want::Cpu => Err("its tensors are on the CPU".into()),
            Want::Cuda(device) => gpu(device),
        })
    }

    /// As it travels: a status byte, then the GPU or the reason.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let (status, text) = match &self.0 {
            Ok(gpu) => (1, gpu),
            Err(why) => (0, why),
        };
        std::iter::once(status)
            .chain(text.bytes().take(4000))
            .collect()
    }

    fn decode(bytes: &[u8]) -> Offer {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        Offer(match bytes.split_first() {
            Some((1, gpu)) => Ok(text(gpu)),
            Some((0, why)) => Err(text(why)),
            _ => Err("sent a malformed NCCL offer (is every rank running the same Hora?)".into()),
        })
    }
}

/// The GPU `device` of this process as no other process's is named: its host and PCI bus id.
fn gpu(device: i32) -> std::result::Result<String, String> {
    let p = probe()?;
    if device < 0 || device as u32 >= p.devices {
        return Err(format!(
            "CUDA device {device} was asked for, but this process sees {} (cuda:0 to cuda:{})",
            p.devices,
            p.devices - 1
        ));
    }
    let api = api()?;
    let mut bus = [0 as c_char; 64];
    // SAFETY: writes at most `bus.len()` bytes, NUL-terminated, for a device index checked
    // above (it does not change the calling thread's device).
    let code = unsafe { (api.pci_bus_id)(bus.as_mut_ptr(), bus.len() as c_int, device) };
    if code != CUDA_SUCCESS {
        return Err(format!(
            "CUDA device {device} cannot be used: {}",
            api.cuda_error(code)
        ));
    }
    // SAFETY: NUL-terminated by cudaDeviceGetPCIBusId within the buffer.
    let bus = unsafe { CStr::from_ptr(bus.as_ptr()) }.to_string_lossy();
    Ok(format!("{bus} on host {}", host()))
}

/// This host, as its kernel's boot id says (two containers of one machine share it), else as
/// `/etc/hostname` does. (Two hosts told apart by neither would look like one: their ranks on
/// GPUs of the same bus ids would be refused as sharing them, and use the ring.)
fn host() -> String {
    ["/proc/sys/kernel/random/boot_id", "/etc/hostname"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .map(|id| id.trim().to_string())
        .find(|id| !id.is_empty())
        .unwrap_or_else(|| "an unnamed host".into())
}

/// The offers of every rank (in rank order) → whether every rank can use NCCL, each on a GPU
/// of its own; else every reason a rank gave, and every GPU two ranks would share.
pub(crate) fn agree_on(offers: &[Vec<u8>]) -> Result<()> {
    let offers: Vec<Offer> = offers.iter().map(|b| Offer::decode(b)).collect();
    let mut refusals: Vec<String> = offers
        .iter()
        .enumerate()
        .filter_map(|(rank, o)| o.0.as_ref().err().map(|why| format!("rank {rank}: {why}")))
        .collect();
    let mut seen: std::collections::BTreeMap<&str, Vec<usize>> = Default::default();
    for (rank, o) in offers.iter().enumerate() {
        if let Ok(gpu) = &o.0 {
            seen.entry(gpu.as_str()).or_default().push(rank);
        }
    }
    for (gpu, ranks) in seen.iter().filter(|(_, r)| r.len() > 1) {
        refusals.push(format!(
            "ranks {ranks:?} would share GPU {gpu}, and NCCL takes one GPU per rank (run at most as many workers on a host as it has GPUs, or give each its own: LOCAL_RANK, CUDA_VISIBLE_DEVICES)"
        ));
    }
    match refusals.is_empty() {
        true => Ok(()),
        false => Err(CollectiveError::Config(format!(
            "NCCL cannot be used by every rank, so no rank uses it ({}); leave the tensors on the CPU, or use the ring on host memory",
            refusals.join("; ")
        ))),
    }
}

/// Rank 0's NCCL id as it travels (once every rank agreed to form the communicator): a status
/// byte, then the id or why it could not be made.
pub(crate) fn make_id() -> Vec<u8> {
    let made = api().and_then(|api| {
        let mut id = UniqueId([0; 128]);
        // SAFETY: ncclGetUniqueId writes one ncclUniqueId.
        match unsafe { (api.get_unique_id)(&mut id) } {
            NCCL_SUCCESS => Ok(id),
            code => Err(format!("ncclGetUniqueId failed: {}", api.nccl_error(code))),
        }
    });
    match made {
        Ok(id) => std::iter::once(1).chain(id.0).collect(),
        Err(why) => std::iter::once(0).chain(why.bytes().take(4000)).collect(),
    }
}

/// The id [`make_id`] sent.
pub(crate) fn read_id(bytes: &[u8]) -> Result<UniqueId> {
    match bytes.split_first() {
        Some((1, id)) if id.len() == 128 => {
            let mut out = [0u8; 128];
            out.copy_from_slice(id);
            Ok(UniqueId(out))
        }
        Some((0, why)) => Err(CollectiveError::Config(format!(
            "rank 0 could not make the NCCL id ({}), so no rank uses NCCL",
            String::from_utf8_lossy(why)
        ))),
        _ => Err(CollectiveError::Protocol(
            "rank 0 sent a malformed NCCL id".into(),
        )),
    }
}

/// The watchdog's state: the deadline of the operation in flight, if any.
#[derive(Default)]
struct Armed {
    deadline: Option<Instant>,
    /// The deadline passed and the communicator was aborted.
    fired: bool,
    stop: bool,
}

/// What the communicator and its watchdog share.
struct Shared {
    armed: Mutex<Armed>,
    wake: Condvar,
    /// The communicator was aborted (by the watchdog, a failure, or the ring): never destroy it.
    aborted: AtomicBool,
}

impl Shared {
    fn armed(&self) -> std::sync::MutexGuard<'_, Armed> {
        self.armed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Aborts the communicator unless it was aborted already.
    fn abort(&self, api: &Api, comm: Handle) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: a communicator its owner has not destroyed (it stops the watchdog first).
            unsafe { (api.comm_abort)(comm.0) };
        }
    }
}

/// Aborts the communicator when an armed deadline passes: the only way to end an NCCL call that
/// blocks (`ncclGroupEnd` while NCCL connects to a dead rank) or a kernel that waits forever.
fn watch(api: Arc<Api>, comm: Handle, shared: Arc<Shared>) {
    let mut armed = shared.armed();
    loop {
        if armed.stop {
            return;
        }
        armed = match armed.deadline {
            None => shared
                .wake
                .wait(armed)
                .unwrap_or_else(PoisonError::into_inner),
            Some(deadline) if Instant::now() >= deadline => {
                armed.deadline = None;
                armed.fired = true;
                shared.abort(&api, comm);
                armed
            }
            Some(deadline) => {
                shared
                    .wake
                    .wait_timeout(armed, deadline.saturating_duration_since(Instant::now()))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
        };
    }
}

/// One rank's NCCL communicator, on one device.
pub struct Nccl {
    api: Arc<Api>,
    comm: Handle,
    device: i32,
    timeout: Duration,
    shared: Arc<Shared>,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time (`&mut self`); each
// call first makes the communicator's device current on the calling thread.
unsafe impl Send for Nccl {}

impl Nccl {
    /// Joins the communicator `id` names as `rank` of `size` on `device`. Every rank calls it
    /// at once; NCCL waits for all of them, here for at most `timeout` (a rank lost meanwhile is
    /// an error, [`CollectiveError::NcclStalled`], and the communicator, should it form later,
    /// is aborted).
    pub(crate) fn init(
        id: UniqueId,
        rank: u32,
        size: u32,
        device: i32,
        timeout: Duration,
    ) -> Result<Nccl> {
        let api = api().map_err(CollectiveError::Nccl)?;
        let (tx, rx) = mpsc::channel::<Result<Handle>>();
        let forming = api.clone();
        std::thread::Builder::new()
            .name("nccl-init".into())
            .spawn(move || {
                let api = forming;
                let made = (|| {
                    // SAFETY: a device index the offers checked.
                    api.cuda("cudaSetDevice", unsafe { (api.set_device)(device) })?;
                    let mut comm: CommHandle = std::ptr::null_mut();
                    // SAFETY: ncclCommInitRank writes one communicator handle.
                    let code = unsafe {
                        (api.comm_init_rank)(&mut comm, size as c_int, id, rank as c_int)
                    };
                    api.nccl("ncclCommInitRank", code).map(|()| Handle(comm))
                })();
                if let Err(mpsc::SendError(Ok(comm))) = tx.send(made) {
                    // Formed after the caller gave up on it: nobody's.
                    // SAFETY: a communicator this thread made and nobody else holds.
                    unsafe { (api.comm_abort)(comm.0) };
                }
            })
            .map_err(|e| CollectiveError::io("starting NCCL's formation", e))?;
        let comm = match rx.recv_timeout(timeout) {
            Ok(made) => made?,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(CollectiveError::NcclStalled(format!(
                    "forming the NCCL communicator did not complete in {} s: a rank died, stalled or cannot reach the others (NCCL connects on sockets of its own: check that the workers' hosts reach each other)",
                    timeout.as_secs_f64()
                )))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(CollectiveError::Nccl(
                    "forming the NCCL communicator ended without an answer".into(),
                ))
            }
        };
        let shared = Arc::new(Shared {
            armed: Mutex::new(Armed::default()),
            wake: Condvar::new(),
            aborted: AtomicBool::new(false),
        });
        let (watching, on) = (api.clone(), shared.clone());
        let watchdog = std::thread::Builder::new()
            .name("nccl-watchdog".into())
            .spawn(move || watch(watching, comm, on));
        let watchdog = match watchdog {
            Ok(handle) => handle,
            Err(e) => {
                shared.abort(&api, comm);
                return Err(CollectiveError::io("starting NCCL's watchdog", e));
            }
        };
        Ok(Nccl {
            api,
            comm,
            device,
            timeout,
            shared,
            watchdog: Some(watchdog),
        })
    }

    /// NCCL's version.
    pub fn version(&self) -> &str {
        &self.api.version
    }

    /// The CUDA device the communicator is on.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// Sums or averages each buffer over the ranks, in place, enqueued on `stream` and waited
    /// for.
    ///
    /// # Safety
    /// Each buffer is `count` elements of `dtype` of device memory on this communicator's
    /// device that nothing frees or resizes until this returns, and `stream` is a live stream of
    /// that device (or null).
    pub(crate) unsafe fn allreduce(
        &mut self,
        bufs: &[DeviceBuffer],
        reduce: Reduce,
        stream: Stream,
    ) -> Result<()> {
        let op = match reduce {
            Reduce::Sum => NCCL_SUM,
            Reduce::Average => NCCL_AVG,
        };
        let (api, comm) = (self.api.clone(), self.comm.0);
        self.run(
            stream,
            |b| {
                // SAFETY: the caller's promise about `b`; in place is allowed by NCCL.
                unsafe { (api.all_reduce)(b.ptr, b.ptr, b.count, b.dtype.code(), op, comm, stream) }
            },
            bufs,
        )
    }

    /// Copies rank `root`'s buffers into every rank's.
    ///
    /// # Safety
    /// As [`Nccl::allreduce`].
    pub(crate) unsafe fn broadcast(
        &mut self,
        bufs: &[DeviceBuffer],
        root: u32,
        stream: Stream,
    ) -> Result<()> {
        let (api, comm) = (self.api.clone(), self.comm.0);
        self.run(
            stream,
            |b| {
                // SAFETY: the caller's promise about `b`.
                unsafe {
                    (api.broadcast)(
                        b.ptr,
                        b.ptr,
                        b.count,
                        b.dtype.code(),
                        root as c_int,
                        comm,
                        stream,
                    )
                }
            },
            bufs,
        )
    }

    /// Enqueues `op` of every buffer as NCCL groups, then waits for the stream, all under the
    /// watchdog's deadline.
    fn run(
        &mut self,
        stream: Stream,
        op: impl Fn(&DeviceBuffer) -> c_int,
        bufs: &[DeviceBuffer],
    ) -> Result<()> {
        if self.shared.aborted.load(Ordering::SeqCst) {
            return Err(CollectiveError::Poisoned(
                "an NCCL collective failed earlier".into(),
            ));
        }
        let api = self.api.clone();
        // SAFETY: a device index checked when the communicator was formed.
        api.cuda("cudaSetDevice", unsafe { (api.set_device)(self.device) })?;
        self.arm(Some(Instant::now() + self.timeout));
        let enqueued = bufs.chunks(GROUP).try_for_each(|group| {
            // SAFETY: group calls take no arguments; every start is matched by an end.
            api.nccl("ncclGroupStart", unsafe { (api.group_start)() })?;
            let enqueued = group
                .iter()
                .try_for_each(|b| api.nccl("an NCCL collective", op(b)));
            // SAFETY: as above.
            let ended = api.nccl("ncclGroupEnd", unsafe { (api.group_end)() });
            enqueued.and(ended)
        });
        let result = enqueued.and_then(|()| self.wait(stream));
        let result = match self.arm(None) {
            // (Whatever the aborted calls answered.)
            true => Err(CollectiveError::NcclStalled(format!(
                "an NCCL collective did not complete in {} s: a rank died or stalled (the communicator is aborted; form a new world)",
                self.timeout.as_secs_f64()
            ))),
            false => result,
        };
        if result.is_err() {
            // A kernel aborted, or still queued behind the caller's work on its stream, is
            // ordered before anything the stream does next: memory freed meanwhile to
            // PyTorch's stream-ordered allocator is not reused under it.
            self.abort();
        }
        result
    }

    /// Sets the watchdog's deadline (None: disarms it); whether it fired since it was last set.
    fn arm(&self, deadline: Option<Instant>) -> bool {
        let mut armed = self.shared.armed();
        let fired = std::mem::take(&mut armed.fired);
        armed.deadline = deadline;
        self.shared.wake.notify_one();
        fired
    }

    /// Waits until `stream` has done its work, the communicator reports an error, or the
    /// watchdog aborts it. Spins at first (a collective of a few MiB takes tens of
    /// microseconds), then sleeps between looks.
    fn wait(&self, stream: Stream) -> Result<()> {
        let started = Instant::now();
        let mut looks: u64 = 0;
        loop {
            // SAFETY: a stream of the communicator's device (the caller's promise), or null.
            match unsafe { (self.api.stream_query)(stream) } {
                CUDA_SUCCESS => return Ok(()),
                CUDA_NOT_READY => {}
                code => {
                    return Err(CollectiveError::Nccl(format!(
                        "the CUDA stream of an NCCL collective failed: {}",
                        self.api.cuda_error(code)
                    )))
                }
            }
            looks += 1;
            if looks % 64 == 0 {
                if self.shared.aborted.load(Ordering::SeqCst) {
                    return Err(CollectiveError::NcclStalled(
                        "the NCCL communicator was aborted during a collective".into(),
                    ));
                }
                let mut state: c_int = NCCL_SUCCESS;
                // SAFETY: writes one ncclResult_t.
                unsafe { (self.api.async_error)(self.comm.0, &mut state) };
                if state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS {
                    return Err(CollectiveError::NcclStalled(format!(
                        "NCCL reports {} during a collective: a rank died or its connection broke",
                        self.api.nccl_error(state)
                    )));
                }
            }
            match started.elapsed() < Duration::from_millis(10) {
                true => std::thread::yield_now(),
                false => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }

    /// Aborts the communicator (it is then never destroyed, which would wait for the other
    /// ranks): after a failure here, or one the ring saw.
    pub(crate) fn abort(&mut self) {
        self.shared.abort(&self.api, self.comm);
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        self.shared.armed().stop = true;
        self.shared.wake.notify_one();
        if let Some(watchdog) = self.watchdog.take() {
            let _ = watchdog.join();
        }
        if self.shared.aborted.load(Ordering::SeqCst) {
            return;
        }
        // SAFETY: a communicator this value owns, with no operation in flight (each waits for
        // its stream before it returns), on its device; the watchdog has stopped.
        unsafe {
            (self.api.set_device)(self.device);
            (self.api.comm_destroy)(self.comm.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::tests::with_world;
    use crate::CommOptions;

    #[test]
    fn a_rank_that_cannot_use_nccl_is_named_on_every_rank_and_the_ring_carries_on() {
        // No machine has a CUDA device this far up: every rank refuses (without a GPU, or
        // without NCCL, for that reason), and every rank says which and why.
        let results = with_world(3, CommOptions::default(), |comm| {
            let refused = comm.use_nccl(1 << 20).err().map(|e| e.to_string());
            let mut v = vec![comm.rank() as f32; 5];
            comm.allreduce(&mut v[..], Reduce::Sum, 1).unwrap();
            (refused, v, comm.nccl().is_none())
        });
        for (refused, v, none) in results {
            let refused = refused.expect("refused");
            for rank in 0..3 {
                assert!(refused.contains(&format!("rank {rank}: ")), "{refused}");
            }
            assert!(refused.contains("no rank uses it"), "{refused}");
            assert_eq!(v, vec![3.0; 5]);
            assert!(none);
        }
        match probe() {
            Ok(p) => eprintln!("NCCL {} with {} CUDA device(s)", p.version, p.devices),
            Err(why) => eprintln!("NCCL cannot run here: {why}"),
        }
    }

    /// With GPUs: CUDA tensors averaged and broadcast through NCCL, on one device per rank, and
    /// a mismatched call refused on every rank. Skipped, saying so, where no GPU is visible.
    #[cfg(feature = "torch")]
    #[test]
    fn cuda_tensors_are_reduced_through_nccl_in_place() {
        use tch::{Device, Kind, Tensor};
        let devices = match probe() {
            Ok(p) => p.devices.min(4),
            Err(why) => {
                eprintln!("skipped: the NCCL path needs a CUDA device ({why})");
                return;
            }
        };
        let len = 1 << 20;
        let results = with_world(devices, CommOptions::default(), |comm| {
            let rank = comm.rank();
            let device = Device::Cuda(rank as usize);
            comm.use_nccl(rank as i32).unwrap();
            let values =
                |r: u32| Tensor::arange(len as i64, (Kind::Float, Device::Cpu)) * f64::from(r + 1);
            let t = values(rank).to_device(device);
            let buf = |t: &Tensor| DeviceBuffer {
                ptr: t.data_ptr(),
                count: t.numel(),
                dtype: DType::F32,
            };
            // SAFETY: `t` is a contiguous f32 tensor on this rank's device, alive throughout.
            unsafe { comm.device_allreduce(&[buf(&t)], Reduce::Average, std::ptr::null_mut(), 7) }
                .unwrap();
            let expected = (0..devices).map(values).fold(
                Tensor::zeros(len as i64, (Kind::Float, Device::Cpu)),
                |a, b| a + b,
            ) / f64::from(devices);
            let err = (t.to_device(Device::Cpu) - &expected)
                .abs()
                .max()
                .double_value(&[]);
            let mine = values(rank).to_device(device);
            let root = devices - 1;
            // SAFETY: as above.
            unsafe { comm.device_broadcast(&[buf(&mine)], root, std::ptr::null_mut(), 8) }.unwrap();
            let broadcast = mine.to_device(Device::Cpu).equal(&values(root));
            let short = Tensor::zeros(len as i64 - i64::from(rank), (Kind::Float, device));
            // SAFETY: as above.
            let mismatch = unsafe {
                comm.device_allreduce(&[buf(&short)], Reduce::Sum, std::ptr::null_mut(), 9)
            };
            (err, broadcast, mismatch.err().map(|e| e.to_string()))
        });
        for (err, broadcast, mismatch) in results {
            assert!(err < 1e-3, "max error {err}");
            assert!(broadcast);
            if devices > 1 {
                assert!(mismatch.expect("refused").contains("differs between ranks"));
            }
        }
    }

    #[test]
    fn offers_travel_and_every_refusal_and_shared_gpu_is_named() {
        let gpu = |bus: &str| Offer(Ok(format!("{bus} on host h"))).encode();
        agree_on(&[gpu("0000:3b:00.0"), gpu("0000:5e:00.0")]).expect("agreed");
        let cpu = Offer::new(Want::Cpu).encode();
        let off = Offer::new(Want::Off).encode();
        let e = agree_on(&[gpu("a"), gpu("b"), cpu, off])
            .expect_err("refused")
            .to_string();
        assert!(
            e.contains("rank 2: its tensors are on the CPU")
                && e.contains("rank 3: its NCCL is turned off"),
            "{e}"
        );
        let e = agree_on(&[gpu("a"), gpu("b"), gpu("a")])
            .expect_err("a shared GPU")
            .to_string();
        assert!(
            e.contains("ranks [0, 2] would share GPU a on host h"),
            "{e}"
        );
        let e = agree_on(&[vec![9, 9]]).expect_err("malformed").to_string();
        assert!(e.contains("malformed NCCL offer"), "{e}");
        let mut id = [1u8; 129];
        id[128] = 9;
        assert_eq!(read_id(&id).expect("an id").0[127], 9);
        let e = read_id(b"\0no library").err().expect("refused").to_string();
        assert!(e.contains("could not make the NCCL id (no library)"), "{e}");
    }

    #[test]
    fn dtypes_are_read_as_pytorch_names_them() {
        assert_eq!(DType::parse("torch.float32"), Some(DType::F32));
        assert_eq!(DType::parse("bfloat16"), Some(DType::BF16));
        assert_eq!(DType::parse("torch.half"), Some(DType::F16));
        assert_eq!(DType::parse("torch.int64"), None);
        assert_eq!(DType::F64.width(), 8);
    }
}
