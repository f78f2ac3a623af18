//! Reading MNIST's IDX files.
//!
//! An IDX file is a big-endian binary array: the magic bytes `00 00`, an
//! element-type byte (`0x08` = unsigned byte, the only type supported here),
//! a dimension-count byte, one big-endian `u32` per dimension, and then the
//! elements in row-major order with nothing after them. Files may also be
//! gzip-compressed (as MNIST is distributed); they are decompressed on the fly.
//!
//! The header is validated before any data is allocated, and compressed data
//! is never decompressed past the size the header declares, so a malformed or
//! hostile file produces a [`DataError`] naming the file and byte offset
//! rather than a panic or an unbounded allocation.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;

use super::{DataError, Dataset};

/// The most elements an IDX file may declare (2^32).
pub const MAX_ELEMENTS: u64 = 1 << 32;

/// IDX element type code for unsigned bytes.
const TYPE_U8: u8 = 0x08;

/// The two magic bytes that start a gzip stream.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// An IDX array of unsigned bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// The dimensions declared in the header, outermost first.
    pub dims: Vec<usize>,
    /// The elements, row-major; `data.len()` is the product of `dims`.
    pub data: Vec<u8>,
}

/// Reads an IDX file of unsigned bytes (type `0x08`), transparently
/// decompressing it if it starts with the gzip magic bytes `1f 8b`.
///
/// Byte offsets in errors about a compressed file refer to the decompressed
/// data.
pub fn read_idx(path: &Path) -> Result<IdxArray, DataError> {
    let io_error = |source| DataError::Io {
        file: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io_error)?;
    let file_len = file.metadata().map_err(io_error)?.len();
    let mut reader = BufReader::new(file);
    let compressed = reader
        .fill_buf()
        .map_err(io_error)?
        .starts_with(&GZIP_MAGIC);
    if compressed {
        read_array(MultiGzDecoder::new(reader), path, None)
    } else {
        read_array(reader, path, Some(file_len))
    }
}

/// Parses an IDX array from `reader`. `known_len` is the total length of the
/// stream when known up front (uncompressed files), which lets size problems
/// be reported before anything is allocated.
fn read_array<R: Read>(
    mut reader: R,
    path: &Path,
    known_len: Option<u64>,
) -> Result<IdxArray, DataError> {
    let note = if known_len.is_none() {
        " (offsets count decompressed bytes)"
    } else {
        ""
    };
    let offset_error = |offset: u64, message: String| DataError::Offset {
        file: path.to_path_buf(),
        offset,
        message: format!("{message}{note}"),
    };
    let io_error = |source| DataError::Io {
        file: path.to_path_buf(),
        source,
    };

    let mut magic = [0u8; 4];
    let got = read_full(&mut reader, &mut magic).map_err(io_error)?;
    if got == 0 {
        return Err(offset_error(
            0,
            "the file is empty; expected an IDX header".to_string(),
        ));
    }
    if magic[..got.min(2)].iter().any(|&b| b != 0) {
        return Err(offset_error(
            0,
            format!(
                "not an IDX file: expected the magic bytes 00 00, found {}; check that this is \
                 an MNIST-style file such as train-images-idx3-ubyte",
                hex(&magic[..got.min(2)])
            ),
        ));
    }
    if got < 4 {
        return Err(offset_error(
            got as u64,
            format!("the header is truncated: the file ends after {got} bytes, inside the 4-byte magic number"),
        ));
    }
    let element_type = magic[2];
    if element_type != TYPE_U8 {
        return Err(offset_error(
            2,
            format!(
                "unsupported element type 0x{element_type:02x} ({}); only 0x08 (unsigned byte) is \
                 supported",
                type_name(element_type)
            ),
        ));
    }
    let ndims = usize::from(magic[3]);
    if ndims == 0 || ndims > 4 {
        return Err(offset_error(
            3,
            format!("the header declares {ndims} dimensions; expected 1 to 4"),
        ));
    }

    let mut dim_bytes = [0u8; 16];
    let dim_bytes = &mut dim_bytes[..4 * ndims];
    let got = read_full(&mut reader, dim_bytes).map_err(io_error)?;
    if got < dim_bytes.len() {
        return Err(offset_error(
            4 + got as u64,
            format!(
                "the header is truncated: {ndims} dimension sizes need {} bytes after the magic \
                 number, but the file ends after {got}",
                dim_bytes.len()
            ),
        ));
    }
    let raw_dims: Vec<u32> = dim_bytes
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let count = raw_dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(u64::from(d)))
        .filter(|&c| c <= MAX_ELEMENTS)
        .ok_or_else(|| {
            offset_error(
                4,
                format!(
                    "the header declares dimensions {raw_dims:?}, more than the supported \
                     {MAX_ELEMENTS} elements; the file is corrupt or not an IDX file"
                ),
            )
        })?;
    let too_big = || {
        offset_error(
            4,
            format!("dimensions {raw_dims:?} are too large for this platform"),
        )
    };
    let dims = raw_dims
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| too_big())?;
    let count_usize = usize::try_from(count).map_err(|_| too_big())?;

    let header_len = 4 + 4 * ndims as u64;
    let end = header_len + count;
    let truncated = |at: u64| {
        offset_error(
            at,
            format!(
                "the data is truncated: the header declares dimensions {dims:?}, i.e. {count} \
                 bytes of data ending at byte offset {end}, but the file ends at offset {at}; \
                 the file is incomplete (re-download it)"
            ),
        )
    };
    let trailing = |extra: Option<u64>| {
        let amount = extra.map_or_else(
            || "unexpected bytes".to_string(),
            |n| format!("{n} unexpected bytes"),
        );
        offset_error(
            end,
            format!(
                "{amount} after the end of the data declared by the header (dimensions {dims:?}); \
                 the file is corrupt or the header is wrong"
            ),
        )
    };

    // With the length known up front, check it before allocating anything.
    let mut data = match known_len {
        Some(len) if len < end => return Err(truncated(len)),
        Some(len) if len > end => return Err(trailing(Some(len - end))),
        Some(_) => Vec::with_capacity(count_usize),
        // Compressed: grow as data actually arrives, bounded by `count`.
        None => Vec::with_capacity(count_usize.min(1 << 20)),
    };
    reader
        .by_ref()
        .take(count)
        .read_to_end(&mut data)
        .map_err(io_error)?;
    if data.len() < count_usize {
        return Err(truncated(header_len + data.len() as u64));
    }
    let mut probe = [0u8; 1];
    if read_full(&mut reader, &mut probe).map_err(io_error)? > 0 {
        return Err(trailing(None));
    }
    Ok(IdxArray { dims, data })
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full<R: Read>(reader: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn type_name(code: u8) -> &'static str {
    match code {
        0x08 => "unsigned byte",
        0x09 => "signed byte",
        0x0B => "i16",
        0x0C => "i32",
        0x0D => "f32",
        0x0E => "f64",
        _ => "not a valid IDX type",
    }
}

/// Loads an MNIST-style pair of IDX files: images `[N, R, C]` of unsigned
/// bytes, scaled to `[0, 1]` (value / 255), and labels `[N]`.
///
/// The result has sample shape `[1, R, C]` and `max(10, largest label + 1)`
/// classes.
pub fn load_mnist(images: &Path, labels: &Path) -> Result<Dataset, DataError> {
    let image_array = read_idx(images)?;
    let [n, rows, cols] = image_array.dims[..] else {
        return Err(DataError::Offset {
            file: images.to_path_buf(),
            offset: 3,
            message: format!(
                "an images file needs 3 dimensions (count, rows, columns), but this one has \
                 dimensions {:?}; is it a labels file?",
                image_array.dims
            ),
        });
    };
    if rows == 0 || cols == 0 {
        return Err(DataError::Offset {
            file: images.to_path_buf(),
            offset: if rows == 0 { 8 } else { 12 },
            message: format!("images of {rows}x{cols} pixels have no pixels"),
        });
    }
    let label_array = read_idx(labels)?;
    let [n_labels] = label_array.dims[..] else {
        return Err(DataError::Offset {
            file: labels.to_path_buf(),
            offset: 3,
            message: format!(
                "a labels file needs 1 dimension (count), but this one has dimensions {:?}; \
                 is it an images file?",
                label_array.dims
            ),
        });
    };
    if n_labels != n {
        return Err(DataError::Offset {
            file: labels.to_path_buf(),
            offset: 4,
            message: format!(
                "the file declares {n_labels} labels but the images file {} declares {n} images; \
                 use the matching pair of files (e.g. train-images with train-labels)",
                images.display()
            ),
        });
    }
    let features = image_array
        .data
        .iter()
        .map(|&b| f32::from(b) / 255.0)
        .collect();
    let labels_vec: Vec<i64> = label_array.data.iter().map(|&b| i64::from(b)).collect();
    let num_classes = label_array
        .data
        .iter()
        .copied()
        .max()
        .map_or(10, |m| (usize::from(m) + 1).max(10));
    Dataset::new(features, labels_vec, vec![1, rows, cols], num_classes).map_err(|e| {
        DataError::Invalid(format!("{} + {}: {e}", images.display(), labels.display()))
    })
}

/// Loads the MNIST `split` from `dir`: `"train"` reads
/// `train-images-idx3-ubyte` and `train-labels-idx1-ubyte`, `"test"` (or
/// `"t10k"`) reads `t10k-images-idx3-ubyte` and `t10k-labels-idx1-ubyte`.
/// Each file may instead carry a `.gz` suffix.
pub fn load_mnist_dir(dir: &Path, split: &str) -> Result<Dataset, DataError> {
    let prefix = match split {
        "train" => "train",
        "test" | "t10k" => "t10k",
        other => {
            return Err(DataError::Invalid(format!(
                "unknown MNIST split {other:?}; use \"train\" or \"test\""
            )))
        }
    };
    let images = find_file(dir, &format!("{prefix}-images-idx3-ubyte"))?;
    let labels = find_file(dir, &format!("{prefix}-labels-idx1-ubyte"))?;
    load_mnist(&images, &labels)
}

/// `dir/name` if it exists, else `dir/name.gz`, else a not-found error.
fn find_file(dir: &Path, name: &str) -> Result<PathBuf, DataError> {
    let plain = dir.join(name);
    if plain.is_file() {
        return Ok(plain);
    }
    let gz = dir.join(format!("{name}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    Err(DataError::Io {
        file: plain,
        source: io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "not found (nor {name}.gz); put the MNIST files in {}",
                dir.display()
            ),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::write::GzEncoder;
    use flate2::Compression;
    use std::io::Write;

    /// Serialises an unsigned-byte IDX array.
    fn idx_bytes(dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut out = vec![0, 0, TYPE_U8, dims.len() as u8];
        for d in dims {
            out.extend_from_slice(&d.to_be_bytes());
        }
        out.extend_from_slice(data);
        out
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut enc = GzEncoder::new(Vec::new(), Compression::default());
        enc.write_all(bytes).expect("compress");
        enc.finish().expect("compress")
    }

    fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).expect("write test file");
        path
    }

    /// Five 2x3 images whose pixel p of image i is `50 * i + p`.
    fn tiny_images() -> Vec<u8> {
        let pixels: Vec<u8> = (0..5u8)
            .flat_map(|i| (0..6u8).map(move |p| 50 * i + p))
            .collect();
        idx_bytes(&[5, 2, 3], &pixels)
    }

    const TINY_LABELS: [u8; 5] = [0, 3, 9, 1, 3];

    fn check_tiny(d: &Dataset) {
        assert_eq!(d.len(), 5);
        assert_eq!(d.sample_shape, vec![1, 2, 3]);
        assert_eq!(d.num_classes, 10);
        assert_eq!(d.labels, vec![0, 3, 9, 1, 3]);
        let (x, y) = d.sample(4).expect("sample 4");
        assert_eq!(y, 3);
        assert_eq!(x[0], 200.0 / 255.0);
        assert_eq!(x[5], 205.0 / 255.0);
        assert!(d.features.iter().all(|&v| (0.0..=1.0).contains(&v)));
    }

    #[test]
    fn reads_plain_and_gzipped_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = idx_bytes(&[2, 2], &[1, 2, 3, 4]);
        let plain = read_idx(&write(&dir, "a.idx", &bytes)).expect("plain");
        assert_eq!(plain.dims, vec![2, 2]);
        assert_eq!(plain.data, vec![1, 2, 3, 4]);
        let gz = read_idx(&write(&dir, "a.idx.gz", &gzip(&bytes))).expect("gz");
        assert_eq!(gz, plain);
        let empty = read_idx(&write(&dir, "e.idx", &idx_bytes(&[0, 28], &[]))).expect("empty");
        assert_eq!(empty.dims, vec![0, 28]);
        assert!(empty.data.is_empty());
    }

    #[test]
    fn loads_mnist_pairs_and_directories() {
        let dir = tempfile::tempdir().expect("tempdir");
        let images = write(&dir, "train-images-idx3-ubyte", &tiny_images());
        let labels = write(
            &dir,
            "train-labels-idx1-ubyte",
            &idx_bytes(&[5], &TINY_LABELS),
        );
        let d = load_mnist(&images, &labels).expect("load");
        check_tiny(&d);
        assert_eq!(load_mnist_dir(dir.path(), "train").expect("dir"), d);

        write(&dir, "t10k-images-idx3-ubyte.gz", &gzip(&tiny_images()));
        write(
            &dir,
            "t10k-labels-idx1-ubyte.gz",
            &gzip(&idx_bytes(&[5], &TINY_LABELS)),
        );
        let test = load_mnist_dir(dir.path(), "test").expect("gz dir");
        assert_eq!(test, d);
        assert_eq!(load_mnist_dir(dir.path(), "t10k").expect("gz dir"), d);

        assert!(load_mnist_dir(dir.path(), "validation")
            .expect_err("bad split")
            .to_string()
            .contains("unknown MNIST split"));
        let empty = tempfile::tempdir().expect("tempdir");
        let err = load_mnist_dir(empty.path(), "train").expect_err("missing");
        assert!(matches!(err, DataError::Io { .. }));
        assert!(err.to_string().contains("train-images-idx3-ubyte"));
    }

    #[test]
    fn large_labels_raise_num_classes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let images = write(&dir, "i", &tiny_images());
        let labels = write(&dir, "l", &idx_bytes(&[5], &[0, 12, 1, 2, 3]));
        assert_eq!(load_mnist(&images, &labels).expect("load").num_classes, 13);
    }

    /// Asserts that reading `bytes` fails naming the file and `offset`, and
    /// mentioning every string in `needles`.
    fn assert_offset_error(bytes: &[u8], offset: u64, needles: &[&str]) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(&dir, "broken-idx", bytes);
        let err = read_idx(&path).expect_err("should fail");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("broken-idx: byte offset {offset}: ")),
            "{msg}"
        );
        for needle in needles {
            assert!(msg.contains(needle), "{msg} lacks {needle:?}");
        }
    }

    #[test]
    fn malformed_files_report_file_and_offset() {
        let good = idx_bytes(&[2, 3], &[1, 2, 3, 4, 5, 6]);
        assert_offset_error(b"PK\x03\x04zipfile", 0, &["magic", "50 4b"]);
        assert_offset_error(b"", 0, &["empty"]);
        assert_offset_error(&[0, 0, 8], 3, &["truncated"]);
        assert_offset_error(
            &[0, 0, 0x0D, 1, 0, 0, 0, 1, 0, 0, 0, 0],
            2,
            &["0x0d", "f32"],
        );
        assert_offset_error(&[0, 0, 8, 0], 3, &["0 dimensions"]);
        assert_offset_error(&[0, 0, 8, 5], 3, &["5 dimensions"]);
        assert_offset_error(&good[..9], 9, &["header is truncated"]);
        // 6 data bytes expected (ending at 18), only 4 present.
        assert_offset_error(&good[..16], 16, &["truncated", "ending at byte offset 18"]);
        let mut trailing = good.clone();
        trailing.extend_from_slice(&[7, 7]);
        assert_offset_error(&trailing, 18, &["2 unexpected bytes"]);
        // 65536 * 65536 * 2 = 2^33 elements: refused before allocating.
        let huge = idx_bytes(&[65536, 65536, 2], &[]);
        assert_offset_error(&huge, 4, &["more than the supported"]);
        let overflow = idx_bytes(&[u32::MAX; 4], &[]);
        assert_offset_error(&overflow, 4, &["more than the supported"]);
    }

    #[test]
    fn malformed_gzipped_files_report_decompressed_offsets() {
        let good = idx_bytes(&[2, 3], &[1, 2, 3, 4, 5, 6]);
        assert_offset_error(&gzip(&good[..16]), 16, &["truncated", "decompressed"]);
        let mut trailing = good.clone();
        trailing.push(0);
        assert_offset_error(&gzip(&trailing), 18, &["unexpected bytes", "decompressed"]);
        // A second gzip member after the data is trailing data too.
        let mut two_members = gzip(&good);
        two_members.extend_from_slice(&gzip(&[9]));
        assert_offset_error(&two_members, 18, &["unexpected bytes"]);
        // Declares 4 GiB but holds a few bytes: fails without allocating it.
        let lying = idx_bytes(&[65536, 65536], &[1, 2, 3]);
        assert_offset_error(&gzip(&lying), 15, &["truncated"]);
        assert_offset_error(&gzip(b"\x08\x03"), 0, &["magic"]);
        // A corrupt compressed stream is an I/O error naming the file.
        let mut corrupt = gzip(&good);
        let len = corrupt.len();
        corrupt.truncate(len - 10);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(&dir, "corrupt.gz", &corrupt);
        let msg = read_idx(&path).expect_err("corrupt").to_string();
        assert!(msg.contains("corrupt.gz"), "{msg}");
    }

    #[test]
    fn mnist_pair_mismatches_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let images = write(&dir, "imgs", &tiny_images());
        let labels4 = write(&dir, "labels4", &idx_bytes(&[4], &[0, 1, 2, 3]));
        let msg = load_mnist(&images, &labels4)
            .expect_err("count mismatch")
            .to_string();
        assert!(msg.contains("labels4: byte offset 4:"), "{msg}");
        assert!(
            msg.contains("4 labels") && msg.contains("5 images"),
            "{msg}"
        );

        let labels = write(&dir, "labels", &idx_bytes(&[5], &TINY_LABELS));
        let msg = load_mnist(&labels, &labels)
            .expect_err("swapped")
            .to_string();
        assert!(
            msg.contains("labels: byte offset 3:") && msg.contains("3 dimensions"),
            "{msg}"
        );
        let msg = load_mnist(&images, &images)
            .expect_err("swapped")
            .to_string();
        assert!(
            msg.contains("imgs: byte offset 3:") && msg.contains("1 dimension"),
            "{msg}"
        );
        let flat = write(&dir, "flat", &idx_bytes(&[5, 0, 3], &[]));
        assert!(load_mnist(&flat, &labels).is_err());
    }
}
