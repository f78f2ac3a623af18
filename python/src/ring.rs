//! `Ring`: Hora's sync ring (the same links, handshake, pipelining and failure reports as
//! `hora-client sync`) over NumPy `float32` buffers, with the GIL released.
//! `hora.sync` builds Horovod's API on it; `PendingRing` is for launchers (Spark's barrier mode)
//! that learn the peers' addresses only after every worker has bound its port.
//!
//! While the GIL is released, any other Python thread may run, and a NumPy array's memory is
//! not pinned by anything Rust can hold: `ndarray.resize(refcheck=False)` frees it whatever
//! buffer exports exist, and a tensor's `set_()` or `resize_()` frees what its `.numpy()` view
//! points at. So by default a collective copies the array into memory of its own (with the
//! GIL held), runs on that, and copies the result back (with the GIL held again, into the
//! array as it is then: one resized meanwhile is refused with ValueError; a *view* whose base
//! was resized points at freed memory in NumPy itself, which is why `hora.sync` hands the ring
//! only arrays of its own). `copy=False` runs in place, for an array that no other thread can
//! reach (`hora.sync`'s own copies).
//!
//! `allreduce_fused` and `broadcast_fused` take a list of arrays and fuse them in Rust
//! (`hora_collective::HostFusion`, Horovod's fusion threshold): each bucket is packed from the
//! arrays into a fusion buffer that Rust owns and unpacked back into them with the GIL held, and
//! only the collective on that buffer runs with the GIL released, so the arrays' memory is never
//! touched while another Python thread may run. `hora.sync` hands it NumPy views of
//! tensors' storage (of a detached tensor, which holds the storage however the original is
//! `set_()` meanwhile).

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use hora_client::sync::ServerRendezvous;
use hora_collective::fusion::{Part, DEFAULT_THRESHOLD};
use hora_collective::nccl::{self, DType, DeviceBuffer, Stream, Want};
use hora_collective::ring::fingerprint;
use hora_collective::{
    bind, connect, form_world, CollectiveError, CommOptions, Communicator, ElasticMeeting,
    HostFusion, LaunchRank, Meeting, Reduce, Rendezvous, Wire, World,
};
use hora_common::wire::SyncRejoin;
use numpy::{PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::sync_error;

fn options(timeout_secs: f64, half_precision: bool, seal_frames: bool) -> PyResult<CommOptions> {
    Ok(CommOptions {
        timeout: crate::seconds("timeout_secs", timeout_secs, 0.1, 3600.0)?,
        wire: if half_precision { Wire::F16 } else { Wire::F32 },
        seal_frames,
        ..CommOptions::default()
    })
}

/// How long a join waits at the server for its world (a newcomer of an elastic job waits for
/// the running world's next commit).
const JOIN_WAIT: Duration = Duration::from_secs(600);

/// The rendezvous of `job` at `server`, waiting and retrying for up to `timeout`.
fn rendezvous<'a>(
    server: &'a str,
    ca: &'a std::path::Path,
    identity: Option<&'a hora_common::tls::Identity>,
    job: &'a str,
    token: &'a str,
    timeout: Duration,
) -> ServerRendezvous<'a> {
    ServerRendezvous {
        server,
        ca,
        identity,
        job,
        token,
        timeout,
        retry_for: timeout,
    }
}

/// A connected worker of a sync job.
#[pyclass(module = "hora._hora", frozen)]
pub(crate) struct Ring {
    comm: Mutex<Communicator>,
    /// The fused collectives' buffer, kept between calls (taken without waiting: a thread that
    /// finds it in use makes its own rather than block with the GIL held).
    fusion: Mutex<HostFusion>,
    rank: u32,
    size: u32,
    generation: u64,
}

impl Ring {
    fn new(comm: Communicator) -> Ring {
        Ring {
            rank: comm.rank(),
            size: comm.size(),
            generation: comm.world().generation,
            comm: Mutex::new(comm),
            fusion: Mutex::new(HostFusion::default()),
        }
    }

    /// Runs a fused collective over `arrays` (see the module's doc): packing and unpacking with
    /// the GIL held, `op` on the fusion buffer with it released.
    fn fused(
        &self,
        py: Python<'_>,
        arrays: &[Bound<'_, PyArrayDyn<f32>>],
        fusion_bytes: usize,
        salt: u64,
        op: impl Fn(&mut Communicator, &mut [f32], u64) -> Result<(), CollectiveError> + Sync,
    ) -> PyResult<()> {
        // NumPy's borrow flags see overlap only between views of one base object; two views of
        // one tensor's storage have different bases. No two parts may share a byte (checked on
        // the raw pointers, before any slice of them exists).
        let mut spans = Vec::with_capacity(arrays.len());
        for (i, a) in arrays.iter().enumerate() {
            if !a.is_c_contiguous() {
                return Err(PyValueError::new_err(format!(
                    "array {i} must be a C-contiguous float32 array"
                )));
            }
            let start = a.data() as usize;
            let end = start + a.len() * std::mem::size_of::<f32>();
            if end > start {
                spans.push((start, end, i));
            }
        }
        spans.sort_unstable();
        if let Some(pair) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(PyValueError::new_err(format!(
                "arrays {} and {} share memory: fuse each buffer once",
                pair[0].2.min(pair[1].2),
                pair[0].2.max(pair[1].2)
            )));
        }
        let mut guards = arrays
            .iter()
            .enumerate()
            .map(|(i, a)| {
                a.try_readwrite().map_err(|e| {
                    PyValueError::new_err(format!(
                        "array {i} is borrowed elsewhere, or listed twice: {e}"
                    ))
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let shapes = arrays
            .iter()
            .map(|a| a.shape().iter().map(|&d| d as u64).collect());
        let mut parts = guards
            .iter_mut()
            .zip(shapes)
            .enumerate()
            .map(|(i, (guard, shape))| {
                let values = guard.as_slice_mut().map_err(|_| {
                    PyValueError::new_err(format!("array {i} must be a C-contiguous float32 array"))
                })?;
                Ok(Part { shape, values })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let mut spare;
        let mut held = self.fusion.try_lock().ok();
        let fusion = match held.as_deref_mut() {
            Some(fusion) => fusion,
            None => {
                spare = HostFusion::default();
                &mut spare
            }
        };
        fusion.set_threshold(fusion_bytes);
        let comm = &self.comm;
        let op = &op;
        fusion
            .run(&mut parts, salt, |buffer, fp| {
                py.detach(move || {
                    let mut comm = comm.lock().unwrap_or_else(|p| p.into_inner());
                    op(&mut comm, buffer, fp)
                })
            })
            .map_err(|e| sync_error(py, e))
    }

    /// `op` on the communicator with the GIL released; its error as `SyncFailed`.
    fn with_comm<T: Send>(
        &self,
        py: Python<'_>,
        op: impl FnOnce(&mut Communicator) -> Result<T, CollectiveError> + Send,
    ) -> PyResult<T> {
        let comm = &self.comm;
        py.detach(move || op(&mut comm.lock().unwrap_or_else(|p| p.into_inner())))
            .map_err(|e| sync_error(py, e))
    }

    /// Runs a collective on `array`'s values with the GIL released: on a copy that Rust owns,
    /// copied back into the array afterwards (`copy`), or on the array's memory itself.
    fn collective(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyArrayDyn<f32>>,
        copy: bool,
        op: impl FnOnce(&mut Communicator, &mut [f32]) -> Result<(), CollectiveError> + Send,
    ) -> PyResult<()> {
        let borrowed = |e| PyValueError::new_err(format!("the buffer is borrowed elsewhere: {e}"));
        let layout = || PyValueError::new_err("the buffer must be a C-contiguous float32 array");
        let comm = &self.comm;
        let run = |values: &mut [f32]| {
            py.detach(move || {
                let mut comm = comm.lock().unwrap_or_else(|p| p.into_inner());
                op(&mut comm, values)
            })
            .map_err(|e| sync_error(py, e))
        };
        if !copy {
            let mut guard = array.try_readwrite().map_err(borrowed)?;
            return run(guard.as_slice_mut().map_err(|_| layout())?);
        }
        // With the GIL held nothing else runs: the copy is of the array as it is.
        let mut owned = {
            let mut guard = array.try_readwrite().map_err(borrowed)?;
            guard.as_slice_mut().map_err(|_| layout())?.to_vec()
        };
        run(&mut owned)?;
        let mut guard = array.try_readwrite().map_err(borrowed)?;
        match guard.as_slice_mut() {
            Ok(values) if values.len() == owned.len() => {
                values.copy_from_slice(&owned);
                Ok(())
            }
            _ => Err(PyValueError::new_err(format!(
                "the array was resized or replaced while the collective ran (it had {} \
                 elements): its result was not written back; do not resize an array that a \
                 collective is using",
                owned.len()
            ))),
        }
    }
}

/// The tag ranks compare before a collective: the call's name and element count.
fn tag(name: &str, len: usize) -> u64 {
    fingerprint(name.bytes().map(u64::from).chain([len as u64]))
}

#[pymethods]
impl Ring {
    /// single() -> Ring
    /// --
    ///
    /// A world of one: every collective is local.
    #[staticmethod]
    fn single() -> Ring {
        Ring::new(Communicator::single())
    }

    /// from_peers(peers, rank, secret=None, timeout_secs=30.0, half_precision=False,
    ///            seal_frames=True) -> Ring
    /// --
    ///
    /// Joins the ring whose workers listen at `peers` (by rank); this worker is `rank` and
    /// accepts on `peers[rank]`. `secret` (16+ characters, the same on every worker) keeps
    /// strangers out. `seal_frames=False` leaves the frames unsealed (on every worker alike).
    #[staticmethod]
    #[pyo3(signature = (peers, rank, secret=None, timeout_secs=30.0, half_precision=false, seal_frames=true))]
    fn from_peers(
        py: Python<'_>,
        peers: Vec<String>,
        rank: u32,
        secret: Option<String>,
        timeout_secs: f64,
        half_precision: bool,
        seal_frames: bool,
    ) -> PyResult<Ring> {
        let launch = LaunchRank {
            rank: Some(rank),
            world_size: Some(peers.len() as u32),
            local_rank: None,
            source: "python",
        };
        let options = options(timeout_secs, half_precision, seal_frames)?;
        py.detach(|| {
            form_world(
                Meeting::Peers { peers, secret },
                &launch,
                "127.0.0.1:0",
                None,
                options,
            )
        })
        .map(Ring::new)
        .map_err(|e| sync_error(py, e))
    }

    /// from_server(server, ca, job, token, world_size, rank=None, listen="127.0.0.1:0",
    ///             advertise=None, timeout_secs=30.0, half_precision=False, seal_frames=True) -> Ring
    /// --
    ///
    /// Meets the job's other workers at the Hora server (`hora-server admin sync-create`).
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (server, ca, job, token, world_size, rank=None, listen="127.0.0.1:0".to_string(), advertise=None, timeout_secs=30.0, half_precision=false, seal_frames=true, cert=None, key=None))]
    fn from_server(
        py: Python<'_>,
        server: String,
        ca: PathBuf,
        job: String,
        token: String,
        world_size: u32,
        rank: Option<u32>,
        listen: String,
        advertise: Option<String>,
        timeout_secs: f64,
        half_precision: bool,
        seal_frames: bool,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> PyResult<Ring> {
        let identity = crate::identity(cert, key)?;
        let launch = LaunchRank {
            rank,
            world_size: Some(world_size),
            local_rank: None,
            source: "python",
        };
        let options = options(timeout_secs, half_precision, seal_frames)?;
        py.detach(|| {
            let rendezvous = rendezvous(&server, &ca, identity.as_ref(), &job, &token, JOIN_WAIT);
            form_world(
                Meeting::Server(&rendezvous),
                &launch,
                &listen,
                advertise.as_deref(),
                options,
            )
        })
        .map(Ring::new)
        .map_err(|e| sync_error(py, e))
    }

    /// join_elastic(server, ca, job, token, max_world_size, rejoin=None, listen="127.0.0.1:0", advertise=None, timeout_secs=30.0, half_precision=False, seal_frames=True, cert=None, key=None) -> Ring
    /// --
    ///
    /// Joins the next world of an elastic job (one created with a minimum world size): as a
    /// survivor, `rejoin` is `(generation, rank, committed)`, the world it was in, its rank
    /// there and how far its last commit is (a step or commit count: larger is newer); a
    /// newcomer passes None and waits (up to ten minutes) for the running world's next commit. The server gives rank 0 to the newest
    /// commit. A world below the job's minimum fails with the ranks that did not come back.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (server, ca, job, token, max_world_size, rejoin=None, listen="127.0.0.1:0".to_string(), advertise=None, timeout_secs=30.0, half_precision=false, seal_frames=true, cert=None, key=None))]
    fn join_elastic(
        py: Python<'_>,
        server: String,
        ca: PathBuf,
        job: String,
        token: String,
        max_world_size: u32,
        rejoin: Option<(u64, u32, u64)>,
        listen: String,
        advertise: Option<String>,
        timeout_secs: f64,
        half_precision: bool,
        seal_frames: bool,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> PyResult<Ring> {
        let identity = crate::identity(cert, key)?;
        let options = options(timeout_secs, half_precision, seal_frames)?;
        let rejoin = rejoin.map(|(generation, rank, committed)| SyncRejoin {
            generation,
            rank,
            committed,
        });
        py.detach(|| {
            let rendezvous = rendezvous(&server, &ca, identity.as_ref(), &job, &token, JOIN_WAIT);
            ElasticMeeting {
                service: &rendezvous,
                listen: &listen,
                advertise: advertise.as_deref(),
                max_world_size,
                options,
            }
            .meet(rejoin)
        })
        .map(Ring::new)
        .map_err(|e| sync_error(py, e))
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// The generation of this world (counts the worlds the job formed; 0 without a server).
    #[getter]
    fn generation(&self) -> u64 {
        self.generation
    }

    #[getter]
    fn size(&self) -> u32 {
        self.size
    }

    /// allreduce(array, average=True, name="", copy=True) -> None
    /// --
    ///
    /// Sums (or averages) a C-contiguous float32 array over all workers, in place. Every
    /// worker must make the same calls with arrays of the same size (and `name`), in the same
    /// order; a mismatch fails every worker instead of hanging. The ring works on a copy of the
    /// array unless `copy=False`, which is only for an array no other thread can reach.
    #[pyo3(signature = (array, average=true, name="", copy=true))]
    fn allreduce(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyArrayDyn<f32>>,
        average: bool,
        name: &str,
        copy: bool,
    ) -> PyResult<()> {
        let reduce = if average {
            Reduce::Average
        } else {
            Reduce::Sum
        };
        self.collective(py, array, copy, move |comm, values| {
            let fp = tag(name, values.len());
            comm.allreduce(values, reduce, fp)
        })
    }

    /// broadcast(array, root=0, name="", copy=True) -> None
    /// --
    ///
    /// Copies `root`'s array into every worker's, in place (on a copy unless `copy=False`, as
    /// `allreduce`).
    #[pyo3(signature = (array, root=0, name="", copy=true))]
    fn broadcast(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyArrayDyn<f32>>,
        root: u32,
        name: &str,
        copy: bool,
    ) -> PyResult<()> {
        self.collective(py, array, copy, move |comm, values| {
            let fp = tag(name, values.len());
            comm.broadcast(values, root, fp)
        })
    }

    /// allreduce_fused(arrays, average=True, fusion_bytes=64 MiB, name="") -> None
    /// --
    ///
    /// Sums (or averages) each C-contiguous float32 array of `arrays` over all workers, in
    /// place, packed into buckets of at most `fusion_bytes` (Horovod's fusion: one collective per
    /// bucket, not per array). Every worker must pass arrays of the same shapes in the same order
    /// (compared before any data moves); the arrays must not overlap.
    #[pyo3(signature = (arrays, average=true, fusion_bytes=DEFAULT_THRESHOLD, name=""))]
    fn allreduce_fused(
        &self,
        py: Python<'_>,
        arrays: Vec<Bound<'_, PyArrayDyn<f32>>>,
        average: bool,
        fusion_bytes: usize,
        name: &str,
    ) -> PyResult<()> {
        let reduce = if average {
            Reduce::Average
        } else {
            Reduce::Sum
        };
        self.fused(
            py,
            &arrays,
            fusion_bytes,
            tag(name, 0),
            |comm, buffer, fp| comm.allreduce(buffer, reduce, fp),
        )
    }

    /// broadcast_fused(arrays, root=0, fusion_bytes=64 MiB, name="") -> None
    /// --
    ///
    /// Copies `root`'s arrays into every worker's, in place, fused as `allreduce_fused`.
    #[pyo3(signature = (arrays, root=0, fusion_bytes=DEFAULT_THRESHOLD, name=""))]
    fn broadcast_fused(
        &self,
        py: Python<'_>,
        arrays: Vec<Bound<'_, PyArrayDyn<f32>>>,
        root: u32,
        fusion_bytes: usize,
        name: &str,
    ) -> PyResult<()> {
        self.fused(
            py,
            &arrays,
            fusion_bytes,
            tag(name, 1),
            |comm, buffer, fp| comm.broadcast(buffer, root, fp),
        )
    }

    /// use_nccl(device, required=True) -> str | None
    /// --
    ///
    /// Forms an NCCL communicator of this world on CUDA device `device` (-1: this worker's
    /// tensors are on the CPU; -2: its NCCL is turned off). Every worker calls it, and either
    /// every worker uses NCCL, each on a GPU of its own, or none does: then, if `required`, every
    /// one raises `SyncFailed` naming each worker that cannot and why; else every one returns
    /// None. Returns NCCL's version when it is used.
    #[pyo3(signature = (device, required=true))]
    fn use_nccl(&self, py: Python<'_>, device: i32, required: bool) -> PyResult<Option<String>> {
        let want = match device {
            -2 => Want::Off,
            d if d < 0 => Want::Cpu,
            d => Want::Cuda(d),
        };
        self.with_comm(py, |comm| comm.attach_nccl(want, required))
    }

    /// release_nccl() -> None
    /// --
    ///
    /// Tears this world's NCCL communicator down (with the GIL released: NCCL's teardown may
    /// wait for the other workers). `hora.sync.shutdown` calls it.
    fn release_nccl(&self, py: Python<'_>) {
        let comm = &self.comm;
        py.detach(move || comm.lock().unwrap_or_else(|p| p.into_inner()).drop_nccl());
    }

    /// nccl_allreduce(buffers, average=True, stream=0, name="") -> None
    /// --
    ///
    /// Sums (or averages) CUDA buffers over all workers through NCCL, in place, as one group:
    /// each `(address, elements, dtype)` of a contiguous tensor on the device `use_nccl` named
    /// (`dtype` as PyTorch names it: float32, float16, bfloat16, float64). Enqueued on
    /// `stream` (a `cudaStream_t`; 0 is the default stream) and waited for. Every worker must
    /// make the same calls with buffers of the same sizes and types (and `name`).
    #[pyo3(signature = (buffers, average=true, stream=0, name=""))]
    fn nccl_allreduce(
        &self,
        py: Python<'_>,
        buffers: Vec<(usize, usize, String)>,
        average: bool,
        stream: usize,
        name: &str,
    ) -> PyResult<()> {
        let bufs = device_buffers(buffers)?;
        let reduce = match average {
            true => Reduce::Average,
            false => Reduce::Sum,
        };
        let fp = tag(name, 0);
        self.with_comm(py, move |comm| {
            // SAFETY: hora.sync passes the addresses of contiguous CUDA tensors it holds until
            // the call returns, on the device NCCL was formed on, and the tensors' stream.
            unsafe { comm.device_allreduce(&bufs, reduce, stream as Stream, fp) }
        })
    }

    /// nccl_broadcast(buffers, root=0, stream=0, name="") -> None
    /// --
    ///
    /// Copies `root`'s CUDA buffers into every worker's through NCCL (buffers as
    /// `nccl_allreduce`).
    #[pyo3(signature = (buffers, root=0, stream=0, name=""))]
    fn nccl_broadcast(
        &self,
        py: Python<'_>,
        buffers: Vec<(usize, usize, String)>,
        root: u32,
        stream: usize,
        name: &str,
    ) -> PyResult<()> {
        let bufs = device_buffers(buffers)?;
        let fp = tag(name, 1);
        self.with_comm(py, move |comm| {
            // SAFETY: as in nccl_allreduce.
            unsafe { comm.device_broadcast(&bufs, root, stream as Stream, fp) }
        })
    }

    /// allgather(data) -> list[bytes]
    /// --
    ///
    /// Every worker's small `data` (metrics, counters; at most a few KiB), in rank order.
    fn allgather<'py>(&self, py: Python<'py>, data: Vec<u8>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let all = self.with_comm(py, |comm| comm.allgather(&data))?;
        Ok(all.iter().map(|b| PyBytes::new(py, b)).collect())
    }
}

/// `(address, elements, dtype)` triples as NCCL takes them.
fn device_buffers(buffers: Vec<(usize, usize, String)>) -> PyResult<Vec<DeviceBuffer>> {
    buffers
        .into_iter()
        .enumerate()
        .map(|(i, (ptr, count, dtype))| {
            let dtype = DType::parse(&dtype).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "buffer {i} is {dtype}: NCCL averages float32, float16, bfloat16 and float64"
                ))
            })?;
            if ptr == 0 && count > 0 {
                return Err(PyValueError::new_err(format!("buffer {i} has no memory")));
            }
            Ok(DeviceBuffer {
                ptr: ptr as *mut std::ffi::c_void,
                count,
                dtype,
            })
        })
        .collect()
}

/// nccl_probe() -> tuple[str | None, int, str | None]
/// --
///
/// Whether this process can use NCCL: (its version, the CUDA devices it sees, None), or
/// (the version if the library loads, 0, why not).
#[pyfunction]
pub(crate) fn nccl_probe() -> (Option<String>, u32, Option<String>) {
    match nccl::probe() {
        Ok(p) => (Some(p.version), p.devices, None),
        Err(why) => (nccl::version().ok(), 0, Some(why)),
    }
}

/// (rank, world size, local rank, where they came from).
type Launch = (Option<u32>, Option<u32>, Option<u32>, &'static str);

/// launch_rank(rank=None, size=None) -> tuple[int | None, int | None, int | None, str]
/// --
///
/// This worker's (rank, world size, local rank, source) as `hora-client sync` finds them:
/// `rank`/`size` (or `HORA_RANK`/`HORA_WORLD_SIZE`) first, then mpirun's, Slurm's, PMI's or
/// torchrun's variables; None where nothing says.
#[pyfunction]
#[pyo3(signature = (rank=None, size=None))]
pub(crate) fn launch_rank(
    py: Python<'_>,
    rank: Option<u32>,
    size: Option<u32>,
) -> PyResult<Launch> {
    let env = |name: &str| std::env::var(name).ok();
    let flag = |value: Option<u32>, name: &str| -> PyResult<Option<u32>> {
        match (value, env(name)) {
            (Some(v), _) => Ok(Some(v)),
            (None, None) => Ok(None),
            (None, Some(v)) => v.trim().parse().map(Some).map_err(|_| {
                PyValueError::new_err(format!("{name}={v:?} is not a non-negative integer"))
            }),
        }
    };
    let found = LaunchRank::detect(
        flag(rank, "HORA_RANK")?,
        flag(size, "HORA_WORLD_SIZE")?,
        env,
    )
    .map_err(|e| sync_error(py, e))?;
    Ok((found.rank, found.world_size, found.local_rank, found.source))
}

/// torchrun_peers() -> list[str] | None
/// --
///
/// The ring's addresses of a job torchrun started on one host (`MASTER_ADDR:MASTER_PORT+1+r`
/// for rank r), as `hora-client sync` finds them; None when torchrun did not start this
/// process. Raises when it started the job on several hosts.
#[pyfunction]
pub(crate) fn torchrun_peers(py: Python<'_>) -> PyResult<Option<Vec<String>>> {
    hora_collective::torchrun_peers(|k| std::env::var(k).ok()).map_err(|e| sync_error(py, e))
}

/// A worker that has bound its ring port but does not know its peers yet.
#[pyclass(module = "hora._hora")]
pub(crate) struct PendingRing {
    listener: Option<TcpListener>,
    address: String,
}

#[pymethods]
impl PendingRing {
    /// PendingRing(listen="127.0.0.1:0", advertise=None)
    /// --
    ///
    /// Binds the ring port now; `address` is what to tell the other workers.
    #[new]
    #[pyo3(signature = (listen="127.0.0.1:0", advertise=None))]
    fn new(py: Python<'_>, listen: &str, advertise: Option<&str>) -> PyResult<Self> {
        let (listener, address) = bind(listen, advertise).map_err(|e| sync_error(py, e))?;
        Ok(PendingRing {
            listener: Some(listener),
            address,
        })
    }

    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// connect(peers, rank, secret, timeout_secs=30.0, half_precision=False, seal_frames=True)
    ///     -> Ring
    /// --
    ///
    /// Joins the ring once every worker's `address` is known (`peers`, by rank, this one's
    /// among them at `rank`).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (peers, rank, secret, timeout_secs=30.0, half_precision=false, seal_frames=true))]
    fn connect(
        &mut self,
        py: Python<'_>,
        peers: Vec<String>,
        rank: u32,
        secret: String,
        timeout_secs: f64,
        half_precision: bool,
        seal_frames: bool,
    ) -> PyResult<Ring> {
        if peers.get(rank as usize) != Some(&self.address) {
            return Err(PyValueError::new_err(format!(
                "peers[{rank}] should be this worker's address {}",
                self.address
            )));
        }
        let listener = self
            .listener
            .take()
            .ok_or_else(|| PyValueError::new_err("this PendingRing was connected already"))?;
        let options = options(timeout_secs, half_precision, seal_frames)?;
        py.detach(move || {
            let world = World::from_peers(peers, rank, Some(&secret))?;
            let listener = (world.size > 1).then_some(listener);
            connect(world, listener, options)
        })
        .map(Ring::new)
        .map_err(|e| sync_error(py, e))
    }
}

/// sync_job_status(server, ca, job, token, timeout_secs=30.0, cert=None, key=None) -> (generation, waiting)
/// --
///
/// An elastic job's generation and the workers waiting to join it, as a running world's rank 0
/// asks at its commits (which also tells the server the world is alive): one try, of at most a
/// third of `timeout_secs` (the ring's, which the other ranks wait meanwhile) and 5 s.
#[pyfunction]
#[pyo3(signature = (server, ca, job, token, timeout_secs=30.0, cert=None, key=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn sync_job_status(
    py: Python<'_>,
    server: String,
    ca: PathBuf,
    job: String,
    token: String,
    timeout_secs: f64,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> PyResult<(u64, u32)> {
    let identity = crate::identity(cert, key)?;
    let timeout = crate::seconds("timeout_secs", timeout_secs, 0.1, 3600.0)?;
    py.detach(|| rendezvous(&server, &ca, identity.as_ref(), &job, &token, timeout).status())
        .map(|s| (s.generation, s.waiting))
        .map_err(|e| sync_error(py, CollectiveError::Rendezvous(e)))
}

/// sync_job_finish(server, ca, job, token, timeout_secs=30.0, cert=None, key=None) -> None
/// --
///
/// Says the job's training finished (its rank 0, once every rank is done): workers that join
/// it later, or are retried by their launcher, are told there is nothing to do.
#[pyfunction]
#[pyo3(signature = (server, ca, job, token, timeout_secs=30.0, cert=None, key=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn sync_job_finish(
    py: Python<'_>,
    server: String,
    ca: PathBuf,
    job: String,
    token: String,
    timeout_secs: f64,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> PyResult<()> {
    let identity = crate::identity(cert, key)?;
    let timeout = crate::seconds("timeout_secs", timeout_secs, 0.1, 3600.0)?;
    py.detach(|| rendezvous(&server, &ca, identity.as_ref(), &job, &token, timeout).finish())
        .map_err(|e| sync_error(py, CollectiveError::Rendezvous(e)))
}
