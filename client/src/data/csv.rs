//! Loading labelled data from delimited text (CSV) files.
//!
//! Every column except the label column is a numeric feature (parsed as a
//! finite `f32`); the label column holds a non-negative integer class (`3` and
//! `3.0` are both accepted). Each loaded sample has shape
//! `[number of feature columns]`.
//!
//! Errors name the file and the 1-based line at fault and say how to fix it.

use std::path::Path;

use ::csv::{ReaderBuilder, StringRecord, Trim};

use super::{DataError, Dataset, MAX_CLASSES};

/// Which column holds the class label.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LabelColumn {
    /// The last column of each row.
    #[default]
    Last,
    /// The column at this 0-based index.
    Index(usize),
    /// The column with this name in the header row (requires a header).
    Name(String),
}

/// How to read a CSV file.
#[derive(Debug, Clone, PartialEq)]
pub struct CsvOptions {
    /// Which column holds the label. Default: the last one.
    pub label: LabelColumn,
    /// Whether the first row is a header. `None` (the default) detects it: the
    /// first row is a header when any of its fields is not a number.
    pub has_header: Option<bool>,
    /// The field delimiter. Default: `b','`.
    pub delimiter: u8,
    /// The number of classes. `None` (the default) uses the largest label
    /// plus one; when given, every label must be below it.
    pub num_classes: Option<usize>,
}

impl Default for CsvOptions {
    fn default() -> Self {
        Self {
            label: LabelColumn::Last,
            has_header: None,
            delimiter: b',',
            num_classes: None,
        }
    }
}

/// Loads a labelled dataset from the CSV file at `path`.
///
/// Blank (empty or whitespace-only) lines and a leading UTF-8 byte-order mark
/// are skipped, and fields are trimmed of surrounding whitespace.
/// All rows must have the same number of fields as the first one.
pub fn load(path: &Path, options: &CsvOptions) -> Result<Dataset, DataError> {
    if let Some(n) = options.num_classes {
        if n == 0 || n > MAX_CLASSES {
            return Err(DataError::Invalid(format!(
                "{}: num_classes must be in 1..={MAX_CLASSES}, got {n}",
                path.display()
            )));
        }
    }
    let bytes = std::fs::read(path).map_err(|source| DataError::Io {
        file: path.to_path_buf(),
        source,
    })?;
    // Skip a UTF-8 byte-order mark, as written by some spreadsheet programs.
    let text = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(&bytes);
    let mut lines = LineCounter::new(text);
    let mut reader = ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .trim(Trim::All)
        .delimiter(options.delimiter)
        .from_reader(text);

    let line_error = |line: u64, message: String| DataError::Line {
        file: path.to_path_buf(),
        line,
        message,
    };

    let mut record = StringRecord::new();
    let mut last_line = 0u64;
    if !read_next(&mut reader, &mut record, path, &mut lines, &mut last_line)? {
        return Err(line_error(
            1,
            "the file is empty; expected rows of numeric features plus a label column".to_string(),
        ));
    }
    let first_line = last_line;
    let width = record.len();
    if width < 2 {
        return Err(line_error(
            first_line,
            format!(
                "found only {width} field; need at least one feature column and a label column \
                 (is the delimiter {:?} right?)",
                char::from(options.delimiter)
            ),
        ));
    }

    let has_header = options
        .has_header
        .unwrap_or_else(|| record.iter().any(|f| f.parse::<f64>().is_err()));
    let names: Option<Vec<String>> = has_header.then(|| record.iter().map(String::from).collect());

    let label_index = match &options.label {
        LabelColumn::Last => width - 1,
        LabelColumn::Index(i) if *i < width => *i,
        LabelColumn::Index(i) => {
            return Err(line_error(
                first_line,
                format!(
                    "label column index {i} (0-based) is out of range: rows have {width} fields, \
                     so the index must be at most {}",
                    width - 1
                ),
            ))
        }
        LabelColumn::Name(name) => match &names {
            None => {
                return Err(line_error(
                    first_line,
                    format!(
                        "the label column is requested by name ({name:?}), but the file has no \
                         header row (this first row is all numeric); add a header or select the \
                         label column by index"
                    ),
                ))
            }
            Some(names) => names.iter().position(|n| n == name).ok_or_else(|| {
                line_error(
                    first_line,
                    format!(
                        "no column named {name:?} in the header; the columns are: {}",
                        names.join(", ")
                    ),
                )
            })?,
        },
    };

    let mut rows = Rows {
        file: path,
        names: names.as_deref(),
        width,
        first_line,
        label_index,
        num_classes: options.num_classes,
        features: Vec::new(),
        labels: Vec::new(),
    };
    if !has_header {
        rows.push(&record, first_line)?;
    }
    while read_next(&mut reader, &mut record, path, &mut lines, &mut last_line)? {
        rows.push(&record, last_line)?;
    }

    if rows.labels.is_empty() {
        return Err(line_error(
            last_line + 1,
            "no data rows after the header; the file needs at least one sample".to_string(),
        ));
    }
    let num_classes = match options.num_classes {
        Some(n) => n,
        // Labels are validated to be in 0..MAX_CLASSES, so this cannot overflow.
        None => rows.labels.iter().copied().max().unwrap_or(0) as usize + 1,
    };
    Dataset::new(rows.features, rows.labels, vec![width - 1], num_classes)
        .map_err(|e| DataError::Invalid(format!("{}: {e}", path.display())))
}

/// Reads the next record that is not blank (empty or whitespace-only lines
/// are skipped); returns `false` at the end of the file. `last_line` is set to
/// the (1-based) line the record starts on.
fn read_next(
    reader: &mut ::csv::Reader<&[u8]>,
    record: &mut StringRecord,
    file: &Path,
    lines: &mut LineCounter<'_>,
    last_line: &mut u64,
) -> Result<bool, DataError> {
    loop {
        match reader.read_record(record) {
            Ok(false) => return Ok(false),
            Ok(true) => {
                if let Some(position) = record.position() {
                    *last_line = lines.line_at(position.byte());
                }
                if record.len() == 1 && record[0].is_empty() {
                    continue;
                }
                return Ok(true);
            }
            Err(err) => {
                let line = match err.position() {
                    Some(position) => lines.line_at(position.byte()),
                    None => *last_line + 1,
                };
                return Err(match err.into_kind() {
                    ::csv::ErrorKind::Io(source) => DataError::Io {
                        file: file.to_path_buf(),
                        source,
                    },
                    ::csv::ErrorKind::Utf8 { err, .. } => DataError::Line {
                        file: file.to_path_buf(),
                        line,
                        message: format!(
                            "column {} is not valid UTF-8 text ({err}); save the file as UTF-8",
                            err.field() + 1
                        ),
                    },
                    other => DataError::Line {
                        file: file.to_path_buf(),
                        line,
                        message: format!("malformed CSV: {other:?}"),
                    },
                });
            }
        }
    }
}

/// Maps byte offsets reported by the CSV reader to 1-based line numbers.
///
/// The reader reports a record's position as where the previous record
/// ended, before any blank lines it skipped, so the line terminators at that
/// offset are skipped here to find the line the record really starts on.
/// `\n`, `\r\n` and a lone `\r` each end a line.
struct LineCounter<'a> {
    text: &'a [u8],
    /// Offset up to which line terminators have been counted.
    pos: usize,
    /// The line `pos` is on.
    line: u64,
}

impl<'a> LineCounter<'a> {
    fn new(text: &'a [u8]) -> Self {
        Self {
            text,
            pos: 0,
            line: 1,
        }
    }

    fn line_at(&mut self, byte: u64) -> u64 {
        let mut target = usize::try_from(byte).map_or(self.text.len(), |b| b.min(self.text.len()));
        while matches!(self.text.get(target), Some(b'\r' | b'\n')) {
            target += 1;
        }
        if target < self.pos {
            // Offsets only move forward in practice; recount if not.
            self.pos = 0;
            self.line = 1;
        }
        for i in self.pos..target {
            let ends_line = match self.text[i] {
                b'\n' => true,
                b'\r' => self.text.get(i + 1) != Some(&b'\n'),
                _ => false,
            };
            if ends_line {
                self.line += 1;
            }
        }
        self.pos = target;
        self.line
    }
}

/// Accumulates validated data rows.
struct Rows<'a> {
    file: &'a Path,
    names: Option<&'a [String]>,
    width: usize,
    first_line: u64,
    label_index: usize,
    num_classes: Option<usize>,
    features: Vec<f32>,
    labels: Vec<i64>,
}

impl Rows<'_> {
    /// A human-readable name for the 0-based column `index`.
    fn column(&self, index: usize) -> String {
        match self.names.and_then(|n| n.get(index)) {
            Some(name) => format!("column {} ({name:?})", index + 1),
            None => format!("column {}", index + 1),
        }
    }

    fn error(&self, line: u64, message: String) -> DataError {
        DataError::Line {
            file: self.file.to_path_buf(),
            line,
            message,
        }
    }

    fn push(&mut self, record: &StringRecord, line: u64) -> Result<(), DataError> {
        if record.len() != self.width {
            return Err(self.error(
                line,
                format!(
                    "row has {} fields but line {} has {}; every row needs the same number of \
                     fields (check for missing or extra delimiters)",
                    record.len(),
                    self.first_line,
                    self.width
                ),
            ));
        }
        let start = self.features.len();
        let mut label = None;
        for (index, field) in record.iter().enumerate() {
            if index == self.label_index {
                label = Some(self.parse_label(field, index, line)?);
            } else {
                match self.parse_feature(field, index, line) {
                    Ok(value) => self.features.push(value),
                    Err(e) => {
                        self.features.truncate(start);
                        return Err(e);
                    }
                }
            }
        }
        match label {
            Some(label) => {
                self.labels.push(label);
                Ok(())
            }
            // Unreachable: label_index < width == record.len().
            None => Err(self.error(line, "row has no label field".to_string())),
        }
    }

    fn parse_feature(&self, field: &str, index: usize, line: u64) -> Result<f32, DataError> {
        if field.is_empty() {
            return Err(self.error(
                line,
                format!(
                    "{} is empty; fill in missing values or drop the row",
                    self.column(index)
                ),
            ));
        }
        let value: f32 = field.parse().map_err(|_| {
            self.error(
                line,
                format!(
                    "{} is not a number: {field:?}; features must be numeric \
                     (encode categorical columns as numbers first)",
                    self.column(index)
                ),
            )
        })?;
        if value.is_nan() {
            return Err(self.error(
                line,
                format!(
                    "{} is NaN; replace missing values before loading",
                    self.column(index)
                ),
            ));
        }
        if value.is_infinite() {
            return Err(self.error(
                line,
                format!(
                    "{} is infinite or too large for f32: {field:?}; features must be finite",
                    self.column(index)
                ),
            ));
        }
        Ok(value)
    }

    fn parse_label(&self, field: &str, index: usize, line: u64) -> Result<i64, DataError> {
        let column = self.column(index);
        let value: f64 = field.parse().map_err(|_| {
            self.error(
                line,
                format!(
                    "label {column} is not a number: {field:?}; labels must be class indices \
                     0, 1, 2, ... (map class names to integers first)"
                ),
            )
        })?;
        if !value.is_finite() {
            return Err(self.error(
                line,
                format!("label {column} is {field:?}; labels must be class indices 0, 1, 2, ..."),
            ));
        }
        if value < 0.0 {
            return Err(self.error(
                line,
                format!("label {column} is negative ({field}); labels must be 0 or greater"),
            ));
        }
        if value.fract() != 0.0 {
            return Err(self.error(
                line,
                format!(
                    "label {column} is not a whole number ({field}); labels must be integer class \
                     indices (is the label column right?)"
                ),
            ));
        }
        if let Some(n) = self.num_classes {
            if value >= n as f64 {
                return Err(self.error(
                    line,
                    format!(
                        "label {field} in {column} is not below num_classes = {n}; fix the label \
                         or raise num_classes"
                    ),
                ));
            }
        }
        if value >= MAX_CLASSES as f64 {
            return Err(self.error(
                line,
                format!(
                    "label {field} in {column} is too large; at most {MAX_CLASSES} classes are \
                     supported"
                ),
            ));
        }
        // In 0..MAX_CLASSES and integral, so the conversion is exact.
        Ok(value as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn write(dir: &tempfile::TempDir, name: &str, contents: &str) -> PathBuf {
        let path = dir.path().join(name);
        std::fs::write(&path, contents).expect("write test file");
        path
    }

    const GOOD: &str = "sepal,petal,species\n1.0,2.5,0\n-3,4e1,2\n\n 0.5 , 0 , 1.0\n";

    #[test]
    fn loads_with_label_last_name_and_index() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(&dir, "good.csv", GOOD);
        let last = load(&path, &CsvOptions::default()).expect("load");
        assert_eq!(last.sample_shape, vec![2]);
        assert_eq!(last.features, vec![1.0, 2.5, -3.0, 40.0, 0.5, 0.0]);
        assert_eq!(last.labels, vec![0, 2, 1]);
        assert_eq!(last.num_classes, 3);

        let by_name = CsvOptions {
            label: LabelColumn::Name("species".into()),
            ..CsvOptions::default()
        };
        assert_eq!(load(&path, &by_name).expect("load"), last);

        let by_index = CsvOptions {
            label: LabelColumn::Index(2),
            num_classes: Some(5),
            ..CsvOptions::default()
        };
        let d = load(&path, &by_index).expect("load");
        assert_eq!(d.num_classes, 5);
        assert_eq!(d.labels, last.labels);

        // Label in the first column, no header, semicolon-delimited.
        let path = write(&dir, "first.csv", "1;0.5;0.25\n0;1;2\n");
        let opts = CsvOptions {
            label: LabelColumn::Index(0),
            delimiter: b';',
            ..CsvOptions::default()
        };
        let d = load(&path, &opts).expect("load");
        assert_eq!(d.labels, vec![1, 0]);
        assert_eq!(d.features, vec![0.5, 0.25, 1.0, 2.0]);
        assert_eq!(d.num_classes, 2);
    }

    #[test]
    fn header_detection_can_be_overridden() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(&dir, "numeric_header.csv", "10,20,1\n1,2,0\n");
        assert_eq!(load(&path, &CsvOptions::default()).expect("load").len(), 2);
        let opts = CsvOptions {
            has_header: Some(true),
            ..CsvOptions::default()
        };
        assert_eq!(load(&path, &opts).expect("load").len(), 1);
        let opts = CsvOptions {
            has_header: Some(false),
            ..CsvOptions::default()
        };
        let err = load(&write(&dir, "h.csv", GOOD), &opts).expect_err("header as data");
        let msg = err.to_string();
        assert!(
            msg.contains("line 1:") && msg.contains("not a number"),
            "{msg}"
        );
    }

    /// Asserts that loading `contents` fails with a message naming the file,
    /// `line {line}`, and every string in `needles`.
    fn assert_fails(contents: &str, options: &CsvOptions, line: u64, needles: &[&str]) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(&dir, "bad_input.csv", contents);
        let err = load(&path, options).expect_err("should fail");
        let msg = err.to_string();
        assert!(msg.contains("bad_input.csv"), "{msg}");
        assert!(msg.contains(&format!(": line {line}: ")), "{msg}");
        for needle in needles {
            assert!(msg.contains(needle), "{msg} lacks {needle:?}");
        }
        assert!(matches!(err, DataError::Line { line: l, .. } if l == line));
    }

    #[test]
    fn malformed_files_report_file_and_line() {
        let d = CsvOptions::default();
        assert_fails(
            "a,b,y\n1,2,0\n1,x,1\n",
            &d,
            3,
            &["column 2 (\"b\")", "\"x\""],
        );
        assert_fails("1,2,0\n3,oops,1\n", &d, 2, &["column 2 ", "not a number"]);
        assert_fails("a,b,y\n1,NaN,0\n", &d, 2, &["NaN"]);
        assert_fails("a,b,y\n1,nan,0\n", &d, 2, &["NaN"]);
        assert_fails("a,b,y\n1,inf,0\n", &d, 2, &["infinite"]);
        assert_fails("a,b,y\n1,1e39,0\n", &d, 2, &["infinite"]);
        assert_fails("a,b,y\n1,,0\n", &d, 2, &["empty"]);
        assert_fails(
            "a,b,y\n1,2,0\n\n1,2\n",
            &d,
            4,
            &["2 fields", "line 1 has 3"],
        );
        assert_fails("a,b,y\n1,2,0\n1,2,3,4\n", &d, 3, &["4 fields"]);
        assert_fails("a,b,y\n1,2,-1\n", &d, 2, &["negative"]);
        assert_fails("a,b,y\n1,2,1.5\n", &d, 2, &["not a whole number"]);
        assert_fails("a,b,y\n1,2,cat\n", &d, 2, &["label column 3 (\"y\")"]);
        assert_fails("a,b,y\n1,2,1e300\n", &d, 2, &["too large"]);
        assert_fails("", &d, 1, &["empty"]);
        assert_fails("\n\n", &d, 1, &["empty"]);
        assert_fails("a,b,y\n", &d, 2, &["no data rows"]);
        assert_fails("1\n2\n", &d, 1, &["only 1 field"]);
        let n3 = CsvOptions {
            num_classes: Some(3),
            ..CsvOptions::default()
        };
        assert_fails("a,b,y\n1,2,0\n1,2,3\n", &n3, 3, &["num_classes = 3"]);
        let by_name = CsvOptions {
            label: LabelColumn::Name("label".into()),
            ..CsvOptions::default()
        };
        assert_fails(
            "a,b,y\n1,2,0\n",
            &by_name,
            1,
            &["no column named \"label\"", "a, b, y"],
        );
        assert_fails("1,2,0\n", &by_name, 1, &["no header row"]);
        let index = CsvOptions {
            label: LabelColumn::Index(3),
            ..CsvOptions::default()
        };
        assert_fails("a,b,y\n1,2,0\n", &index, 1, &["index 3", "out of range"]);
        assert_fails("a,b,y\n1,2,0\n1,2,\u{fffd}\n", &d, 3, &["not a number"]);
    }

    #[test]
    fn line_numbers_survive_blank_lines_crlf_and_quotes() {
        let d = CsvOptions::default();
        assert_fails("\n\na,b,y\n1,2,0\n1,x,0\n", &d, 5, &["\"x\""]);
        assert_fails("a,b,y\r\n\r\n1,2,0\r\n1,x,0\r\n", &d, 4, &["\"x\""]);
        assert_fails("a,b,y\n  \n1,2,0\n\n\n1,2\n", &d, 6, &["2 fields"]);
        assert_fails("a,b,y\r1,2,0\r1,x,0\r", &d, 3, &["\"x\""]);
        assert_fails("a,b,y\n1,\"2\n\",0\n1,x,0\n", &d, 4, &["\"x\""]);
        assert_fails(
            "\u{feff}a,b,y\n1,2,0\n1,x,0\n",
            &d,
            3,
            &["column 2 (\"b\")"],
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(&dir, "bom.csv", "\u{feff}1,2,0\n\n3,4,1\n  \n");
        let data = load(&path, &d).expect("BOM and blank lines are fine");
        assert_eq!(data.labels, vec![0, 1]);
    }

    #[test]
    fn invalid_utf8_and_missing_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("latin1.csv");
        std::fs::write(&path, b"a,b,y\n1,2,0\n1,\xff,1\n").expect("write");
        let msg = load(&path, &CsvOptions::default())
            .expect_err("invalid utf-8")
            .to_string();
        assert!(
            msg.contains("latin1.csv: line 3:") && msg.contains("UTF-8"),
            "{msg}"
        );

        let missing = dir.path().join("missing.csv");
        let err = load(&missing, &CsvOptions::default()).expect_err("missing");
        assert!(matches!(err, DataError::Io { .. }));
        assert!(err.to_string().contains("missing.csv"));

        let opts = CsvOptions {
            num_classes: Some(0),
            ..CsvOptions::default()
        };
        assert!(load(&write(&dir, "x.csv", GOOD), &opts).is_err());
    }
}
