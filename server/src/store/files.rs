//! Blob formats and file handling shared by the stores: the checkpoint encoding (a fresh name, a
//! SHA-256 trailer) and the masked-sum encoding (content-addressed), temporary names, private
//! folders.

use std::fs;
use std::io::Read;
use std::path::Path;

use super::StoreError;

/// Checkpoints with a trailer of their SHA-256, named by [`fresh_name`].
const CHECKPOINT_MAGIC: &[u8; 8] = b"HORACKP2";
/// Checkpoints of earlier versions, named by the SHA-256 of their bytes (still read).
const CHECKPOINT_MAGIC_V1: &[u8; 8] = b"HORACKP1";
const MASKED_SUM_MAGIC: &[u8; 8] = b"HORAMSK1";
/// A serving replica's masked partial sum: a masked sum followed by 16 random bytes, so that its
/// content address is its own (two replicas' partials never share a blob, whatever they hold).
const MASKED_PARTIAL_MAGIC: &[u8; 8] = b"HORAMSP1";

/// Maps an I/O error on `path` to a [`StoreError`].
pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| {
        carried(source).unwrap_or_else(|source| StoreError::Io {
            path: path.display().to_string(),
            source,
        })
    }
}

/// Maps an I/O error on blob `what` to a [`StoreError`].
pub(super) fn io_at(what: &str) -> impl Fn(std::io::Error) -> StoreError + '_ {
    move |source| {
        carried(source).unwrap_or_else(|source| StoreError::Io {
            path: what.to_string(),
            source,
        })
    }
}

/// The store's own error that an I/O error carries (a blob store failing under a reader or a
/// writer: an outage, answered 503, not a broken file), else the I/O error.
pub(crate) fn carried(e: std::io::Error) -> Result<StoreError, std::io::Error> {
    if e.get_ref().is_some_and(|inner| inner.is::<StoreError>()) {
        let inner = e.into_inner().expect("checked above");
        return Ok(*inner.downcast::<StoreError>().expect("checked above"));
    }
    Err(e)
}

/// An I/O error reading stored data: corruption where the data ran short (`reason`), the
/// store's own error where it carries one.
pub(crate) fn short_or_carried(
    e: std::io::Error,
    corrupt: impl FnOnce() -> StoreError,
) -> StoreError {
    carried(e).unwrap_or_else(|_| corrupt())
}

/// A name no blob has, for a temporary file: the sweep removes what a crash leaves of these.
pub(super) fn temp_name(kind: &str) -> String {
    format!(
        ".tmp-{kind}{}-{}",
        std::process::id(),
        rand::random::<u64>()
    )
}

/// Creates `dir` (and its parents) if needed and makes it accessible to this user only.
pub(super) fn make_private_dir(dir: &Path) -> Result<(), StoreError> {
    fs::create_dir_all(dir).map_err(io(dir))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io(dir))?;
    }
    Ok(())
}

/// A name for a blob written under it from its first byte (so an object store puts it once and
/// never copies it), of `extension`: 128 random bits, so no two writes share one. Such a blob
/// proves its contents by a trailer ([`Sealing`]) rather than by its name.
pub(crate) fn fresh_name(extension: &str) -> String {
    format!("{:032x}.{extension}", rand::random::<u128>())
}

/// How a blob that is read proves its contents, once every byte of its body went through
/// [`Sealing::hash`]: blobs of a first format by their name, the SHA-256 of their bytes
/// (`<64 hex>.<extension>`); blobs of a second format, written under a [`fresh_name`], by a
/// trailer of the 32-byte SHA-256 of every byte before it.
pub(crate) struct Sealing {
    pub(crate) hash: ring::digest::Context,
    trailer: bool,
}

impl Sealing {
    /// A reading of a blob whose header said whether it carries a `trailer`.
    pub(crate) fn new(trailer: bool) -> Sealing {
        Sealing {
            hash: ring::digest::Context::new(&ring::digest::SHA256),
            trailer,
        }
    }

    /// After the body: checks the trailer (if the format has one), that nothing follows, and
    /// for the first formats that the bytes match `name`. The reason it failed, else nothing.
    pub(crate) fn check(
        self,
        mut r: impl Read,
        name: &str,
        extension: &str,
    ) -> Result<Result<(), String>, std::io::Error> {
        let digest = self.hash.finish();
        if self.trailer {
            let mut trailer = [0u8; 32];
            if let Err(e) = r.read_exact(&mut trailer) {
                return match e.kind() {
                    std::io::ErrorKind::UnexpectedEof => Ok(Err("truncated".into())),
                    _ => Err(e),
                };
            }
            if trailer != digest.as_ref() {
                return Ok(Err("contents do not match their checksum".into()));
            }
        }
        if r.read(&mut [0u8; 1])? != 0 {
            return Ok(Err("trailing bytes".into()));
        }
        if !self.trailer && format!("{}.{extension}", hex::encode(digest)) != name {
            return Ok(Err(
                "contents do not match the file's content address".into()
            ));
        }
        Ok(Ok(()))
    }
}

/// Feeds the encoding of an accumulator checkpoint to `put`, piece by piece so that the sum is
/// never held twice: `"HORACKP2"`, the u64 count, the f64 values, all little-endian, then the
/// SHA-256 of all of it (a checkpoint is written under a [`fresh_name`]).
pub(super) fn encode_checkpoint(
    sum: &[f64],
    mut put: impl FnMut(&[u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
    let mut hashed = |bytes: &[u8]| {
        hash.update(bytes);
        put(bytes)
    };
    hashed(CHECKPOINT_MAGIC)?;
    hashed(&(sum.len() as u64).to_le_bytes())?;
    let mut buf = Vec::with_capacity(8 << 16);
    for chunk in sum.chunks(1 << 16) {
        buf.clear();
        buf.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
        hashed(&buf)?;
    }
    put(hash.finish().as_ref())
}

/// Reads the checkpoint named `file` from `r`, checking its header against `expected_len` and
/// its contents against its trailer (or, written by an earlier version, its name). `read_error`
/// maps a failure to read the header or to look past the end (the data itself running short is
/// corruption).
pub(super) fn decode_checkpoint(
    mut r: impl Read,
    file: &str,
    expected_len: usize,
    read_error: impl Fn(std::io::Error) -> StoreError,
) -> Result<Vec<f64>, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        key: file.into(),
        reason,
    };
    let mut header = [0u8; 16];
    r.read_exact(&mut header).map_err(&read_error)?;
    let trailer = match &header[..8] {
        m if m == CHECKPOINT_MAGIC => true,
        m if m == CHECKPOINT_MAGIC_V1 => false,
        _ => return Err(corrupt("not a checkpoint".into())),
    };
    let mut sealing = Sealing::new(trailer);
    sealing.hash.update(&header);
    let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
    if len != expected_len as u64 {
        return Err(corrupt(format!(
            "expected {expected_len} values, header says {len}"
        )));
    }
    // Read in pieces: the sum is the largest thing the server holds; never hold it twice.
    let mut values = Vec::with_capacity(expected_len);
    let mut buf = vec![0u8; 1 << 20];
    while values.len() < expected_len {
        let want = ((expected_len - values.len()) * 8).min(buf.len());
        r.read_exact(&mut buf[..want])
            .map_err(|e| short_or_carried(e, || corrupt("truncated".into())))?;
        sealing.hash.update(&buf[..want]);
        values.extend(
            buf[..want]
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes"))),
        );
    }
    sealing
        .check(r, file, "ckpt")
        .map_err(&read_error)?
        .map_err(corrupt)?;
    Ok(values)
}

/// The encoding of a secure-aggregation masked sum (`"HORAMSK1"`, then u32 little-endian) and
/// its name, the SHA-256 of the encoding.
pub(super) fn encode_masked_sum(sum: &[u32]) -> (String, Vec<u8>) {
    let mut bytes = Vec::with_capacity(8 + sum.len() * 4);
    bytes.extend_from_slice(MASKED_SUM_MAGIC);
    bytes.extend(sum.iter().flat_map(|v| v.to_le_bytes()));
    let name = format!("{}.msum", hora_common::sha256_hex(&bytes));
    (name, bytes)
}

/// A replica's masked partial sum, salted (see [`MASKED_PARTIAL_MAGIC`]): its name and bytes.
pub(super) fn encode_masked_partial(sum: &[u32]) -> (String, Vec<u8>) {
    let mut bytes = Vec::with_capacity(8 + sum.len() * 4 + 16);
    bytes.extend_from_slice(MASKED_PARTIAL_MAGIC);
    bytes.extend(sum.iter().flat_map(|v| v.to_le_bytes()));
    bytes.extend(rand::random::<u128>().to_le_bytes());
    let name = format!("{}.msum", hora_common::sha256_hex(&bytes));
    (name, bytes)
}

/// Decodes the masked sum (or partial sum) named `file`, checking its length and its content
/// address.
pub(super) fn decode_masked_sum(
    bytes: &[u8],
    file: &str,
    expected_len: usize,
) -> Result<Vec<u32>, StoreError> {
    let corrupt = |reason: &str| StoreError::Corrupt {
        key: file.into(),
        reason: reason.into(),
    };
    let salt = match bytes.get(..8) {
        Some(magic) if magic == MASKED_SUM_MAGIC => 0,
        Some(magic) if magic == MASKED_PARTIAL_MAGIC => 16,
        _ => return Err(corrupt("not a masked sum")),
    };
    if bytes.len() != 8 + expected_len * 4 + salt {
        return Err(corrupt("not a masked sum of the expected length"));
    }
    if format!("{}.msum", hora_common::sha256_hex(bytes)) != file {
        return Err(corrupt("contents do not match the file's content address"));
    }
    Ok(le_words(&bytes[8..bytes.len() - salt]).collect())
}

/// Little-endian u32 words of `bytes` (a masked input or sum; a trailing partial word is ignored).
pub fn le_words(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blob_store_failing_under_a_reader_is_an_outage_not_corruption() {
        let outage = || {
            std::io::Error::other(StoreError::Blobs {
                at: "s3://b/p".into(),
                reason: "connection reset".into(),
            })
        };
        let corrupt = || StoreError::Corrupt {
            key: "k".into(),
            reason: "truncated".into(),
        };
        assert!(matches!(io_at("k")(outage()), StoreError::Blobs { .. }));
        assert!(matches!(
            short_or_carried(outage(), corrupt),
            StoreError::Blobs { .. }
        ));
        let short = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        assert!(matches!(
            short_or_carried(short, corrupt),
            StoreError::Corrupt { .. }
        ));
        let other = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert!(matches!(io_at("k")(other), StoreError::Io { .. }));
    }
}
