//! Tables and data pointers: a tenant uploads a table (CSV, JSON records or
//! an Arrow IPC stream) once, gets an opaque, unguessable pointer, and runs
//! refer to it by pointer; the worker hydrates it straight into R vectors.
//!
//! Storage is the shared blob store (crate::blob): one index entry and one
//! Arrow IPC file per table, so pointers survive a restart until they
//! expire and resolve on every node that shares the store; a node caches
//! the files it hands to workers in its data directory.

use crate::blob::{BlobError, BlobStore, StoreUrl};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use rvisor::clock::{rfc3339, unix_now};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where tables live and how much a tenant may keep.
#[derive(Debug, Clone)]
pub struct TableConfig {
    /// Data directory.
    pub dir: PathBuf,
    /// How long a pointer lives.
    pub ttl: Duration,
    /// Bytes a tenant may keep.
    pub max_bytes_per_tenant: u64,
    /// Tables a tenant may keep.
    pub max_tables_per_tenant: usize,
    /// Bytes one stored table may take (its Arrow file).
    pub max_stored_bytes_per_table: u64,
    /// Uploads converted at once; more wait for a turn.
    pub max_conversions: usize,
    /// How long an upload waits for its turn before it is refused as busy
    /// (503 with Retry-After).
    pub conversion_wait: Duration,
    /// The shared store of index entries and Arrow files; `None`: the
    /// directory `{dir}/store` (one node, or nodes sharing the directory
    /// on one host).
    pub store: Option<StoreUrl>,
}

impl Default for TableConfig {
    fn default() -> Self {
        Self {
            dir: std::env::temp_dir().join("rvisor-tables"),
            ttl: Duration::from_secs(24 * 3600),
            max_bytes_per_tenant: 1 << 30,
            max_tables_per_tenant: 100,
            max_stored_bytes_per_table: 1 << 30,
            max_conversions: 2,
            conversion_wait: Duration::from_secs(60),
            store: None,
        }
    }
}

/// The input format of an upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFormat {
    /// CSV with a header line; `NA` and empty fields are missing values.
    Csv,
    /// A JSON array of records (objects).
    Json,
    /// An Arrow IPC stream.
    ArrowStream,
}

/// One column as the API reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ColumnMeta {
    /// Name.
    pub name: String,
    /// integer, double, logical, string, date or timestamp.
    #[serde(rename = "type")]
    pub kind: String,
}

/// A stored table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TableMeta {
    /// The opaque pointer.
    pub data_pointer: String,
    /// Rows.
    pub rows: u64,
    /// Columns in order.
    pub columns: Vec<ColumnMeta>,
    /// When the pointer stops working (RFC 3339, UTC).
    pub expires_at: String,
    /// Bytes stored.
    pub bytes: u64,
    #[serde(skip_serializing_if = "String::is_empty", default)]
    #[schema(ignore)]
    tenant: String,
    #[serde(skip_serializing_if = "is_zero", default)]
    #[schema(ignore)]
    expires_unix: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Why a table was refused.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// The upload is not a table rvisor can read.
    #[error("{0}")]
    Invalid(String),
    /// The tenant's quota would be exceeded.
    #[error("{0}")]
    Quota(String),
    /// The table is over the per-table size limit.
    #[error("{0}")]
    TooLarge(String),
    /// Too many tables are being converted at once; try again shortly.
    #[error("{0}")]
    Busy(String),
    /// Storage failed.
    #[error("failed to store the table: {0}")]
    Io(#[from] std::io::Error),
}

fn kind_of(t: &DataType) -> Option<&'static str> {
    Some(match t {
        DataType::Int64 => "integer",
        DataType::Float64 => "double",
        DataType::Boolean => "logical",
        DataType::Utf8 => "string",
        DataType::Date32 => "date",
        DataType::Timestamp(_, _) => "timestamp",
        DataType::Null => "logical",
        _ => return None,
    })
}

/// Casts a column to the set the worker hydrates: Int64, Float64, Boolean,
/// Utf8, Date32, Timestamp.
fn normalise(name: &str, col: &ArrayRef) -> Result<ArrayRef, TableError> {
    use DataType as T;
    let target = match col.data_type() {
        T::Int8 | T::Int16 | T::Int32 | T::Int64 | T::UInt8 | T::UInt16 | T::UInt32 => T::Int64,
        T::UInt64 | T::Float16 | T::Float32 | T::Float64 | T::Decimal128(_, _) => T::Float64,
        T::Utf8 | T::LargeUtf8 | T::Utf8View | T::Dictionary(_, _) => T::Utf8,
        T::Boolean | T::Null => T::Boolean,
        T::Date32 | T::Date64 => T::Date32,
        T::Timestamp(_, tz) => T::Timestamp(TimeUnit::Microsecond, tz.clone()),
        other => {
            return Err(TableError::Invalid(format!(
                "column {name:?} has type {other}, which rvisor cannot hand to R; use numbers, \
                 strings, booleans, dates or timestamps"
            )))
        }
    };
    if col.data_type() == &target {
        return Ok(col.clone());
    }
    arrow_cast::cast(col, &target)
        .map_err(|e| TableError::Invalid(format!("column {name:?} could not be converted: {e}")))
}

/// JSON has no date type: a string column whose every value parses as a
/// date (or timestamp) becomes one.
fn coerce_dates(col: ArrayRef) -> ArrayRef {
    if col.data_type() != &DataType::Utf8 || col.len() == col.null_count() {
        return col;
    }
    let strict = arrow_cast::CastOptions {
        safe: false,
        ..Default::default()
    };
    let looks_like_date = {
        let s = col.as_any().downcast_ref::<arrow_array::StringArray>();
        s.is_some_and(|s| {
            s.iter().flatten().all(|v| {
                let b = v.as_bytes();
                b.len() >= 10
                    && b[4] == b'-'
                    && b[7] == b'-'
                    && b[..4].iter().all(u8::is_ascii_digit)
            })
        })
    };
    if !looks_like_date {
        return col;
    }
    for target in [
        DataType::Date32,
        DataType::Timestamp(TimeUnit::Microsecond, None),
    ] {
        if let Ok(c) = arrow_cast::cast_with_options(&col, &target, &strict) {
            if target == DataType::Date32 {
                // A timestamp string cast to a date silently drops the time:
                // only accept dates if every value is exactly YYYY-MM-DD.
                let s = col.as_any().downcast_ref::<arrow_array::StringArray>();
                if !s.is_some_and(|s| s.iter().flatten().all(|v| v.len() == 10)) {
                    continue;
                }
            }
            return c;
        }
    }
    col
}

/// A batch source: the schema and the batches, read in bounded memory.
type Batches = (
    SchemaRef,
    Box<dyn Iterator<Item = Result<RecordBatch, arrow_schema::ArrowError>>>,
);

/// Rows per batch while converting: bounds the memory one conversion holds.
const BATCH_ROWS: usize = 16 * 1024;
/// Rows of a CSV read to infer column types.
const INFER_ROWS: usize = 100_000;

/// Rewrites a JSON array of records as one record per line (NDJSON) in
/// `out`, one record in memory at a time.
fn json_array_to_ndjson(src: &Path, out: &Path) -> Result<(), TableError> {
    struct Records<'a, W: Write>(&'a mut W);
    impl<'de, W: Write> serde::de::Visitor<'de> for Records<'_, W> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON array of records")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            use serde::de::Error;
            while let Some(raw) = seq.next_element::<Box<serde_json::value::RawValue>>()? {
                let text = raw.get();
                if !text.starts_with('{') {
                    return Err(A::Error::custom(
                        "every element of the JSON array must be an object (a record)",
                    ));
                }
                // A record names at least one field (the request schema's
                // `minProperties: 1`): `{}` would be a row of nothing.
                if text[1..].trim_start().starts_with('}') {
                    return Err(A::Error::custom(
                        "every record must have at least one field; {} has none",
                    ));
                }
                self.0
                    .write_all(text.as_bytes())
                    .and_then(|()| self.0.write_all(b"\n"))
                    .map_err(A::Error::custom)?;
            }
            Ok(())
        }
    }
    let input = std::io::BufReader::new(std::fs::File::open(src)?);
    let mut w = std::io::BufWriter::new(std::fs::File::create(out)?);
    let mut de = serde_json::Deserializer::from_reader(input);
    serde::Deserializer::deserialize_seq(&mut de, Records(&mut w)).map_err(|e| {
        if e.to_string().contains("must be an object") {
            TableError::Invalid(
                "every element of the JSON array must be an object (a record)".into(),
            )
        } else if e.to_string().contains("at least one field") {
            TableError::Invalid("every record must have at least one field; {} has none".into())
        } else {
            TableError::Invalid(format!("the body is not a JSON array of records: {e}"))
        }
    })?;
    de.end().map_err(|e| {
        TableError::Invalid(format!("the body is not a JSON array of records: {e}"))
    })?;
    w.flush()?;
    Ok(())
}

/// Opens the upload at `src` as batches. A JSON upload is first rewritten
/// as NDJSON into `scratch`.
fn read_upload(format: TableFormat, src: &Path, scratch: &Path) -> Result<Batches, TableError> {
    use std::io::{BufReader, Seek};
    let bad = |what: &str, e: &dyn std::fmt::Display| TableError::Invalid(format!("{what}: {e}"));
    match format {
        TableFormat::Csv => {
            let null = regex::Regex::new("^(NA|)$").map_err(|e| bad("internal", &e))?;
            let fmt = arrow_csv::reader::Format::default()
                .with_header(true)
                .with_null_regex(null);
            let mut file = std::fs::File::open(src)?;
            let (schema, _) = fmt
                .infer_schema(BufReader::new(&mut file), Some(INFER_ROWS))
                .map_err(|e| bad("the CSV could not be read", &e))?;
            file.rewind()?;
            let schema = Arc::new(schema);
            let reader = arrow_csv::ReaderBuilder::new(schema.clone())
                .with_format(fmt)
                .with_batch_size(BATCH_ROWS)
                .build(BufReader::new(file))
                .map_err(|e| bad("the CSV could not be read", &e))?;
            Ok((schema, Box::new(reader)))
        }
        TableFormat::Json => {
            json_array_to_ndjson(src, scratch)?;
            // Every record is read to type the columns (one more pass over
            // the file, in bounded memory): a key whose values are of more
            // than one kind (a number here, a string there) becomes a
            // string column, its numbers and booleans written as text, as
            // jsonlite's fromJSON() makes it. Any JSON array of flat
            // records is then a table, as the request schema says.
            let (schema, _) = arrow_json::reader::infer_json_schema(
                BufReader::new(std::fs::File::open(scratch)?),
                None,
            )
            .map_err(|e| bad("the records could not be typed", &e))?;
            let schema = Arc::new(schema);
            let reader = arrow_json::ReaderBuilder::new(schema.clone())
                .with_coerce_primitive(true)
                .with_batch_size(BATCH_ROWS)
                .build(BufReader::new(std::fs::File::open(scratch)?))
                .map_err(|e| bad("the records could not be read", &e))?;
            Ok((schema, Box::new(reader)))
        }
        TableFormat::ArrowStream => {
            let reader = arrow_ipc::reader::StreamReader::try_new(
                BufReader::new(std::fs::File::open(src)?),
                None,
            )
            .map_err(|e| bad("the body is not an Arrow IPC stream", &e))?;
            let schema = reader.schema();
            Ok((schema, Box::new(reader)))
        }
    }
}

/// A writer that counts what goes through it, so a conversion can stop as
/// soon as its output passes its budget.
struct Counting<W> {
    inner: W,
    written: Arc<std::sync::atomic::AtomicU64>,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// How much a conversion may write, and what to say when it passes that.
#[derive(Debug, Clone, Copy)]
struct Budget {
    /// Bytes the stored file may take.
    bytes: u64,
    /// Whether the tenant's quota (rather than the per-table limit) is the
    /// smaller bound.
    quota: bool,
}

/// Reads the upload at `src` batch by batch, normalises its columns and
/// writes it as an Arrow IPC file at `path`, stopping as soon as the output
/// passes `budget`. Returns rows and column metadata.
fn convert(
    format: TableFormat,
    src: &Path,
    path: &Path,
    budget: Option<Budget>,
) -> Result<(u64, Vec<ColumnMeta>), TableError> {
    let scratch = path.with_extension("ndjson");
    let converted = convert_with(format, src, path, &scratch, budget);
    let _ = std::fs::remove_file(&scratch);
    if converted.is_err() {
        let _ = std::fs::remove_file(path.with_extension("tmp"));
    }
    // Without it the allocator keeps the conversion's peak for the
    // process's life.
    crate::heap::give_back();
    converted
}

fn convert_with(
    format: TableFormat,
    src: &Path,
    path: &Path,
    scratch: &Path,
    budget: Option<Budget>,
) -> Result<(u64, Vec<ColumnMeta>), TableError> {
    let (schema, batches) = read_upload(format, src, scratch)?;
    if schema.fields().is_empty() {
        return Err(TableError::Invalid("the table has no columns".into()));
    }
    let tmp = path.with_extension("tmp");
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let over = |written: u64| -> Result<(), TableError> {
        match budget {
            Some(b) if written > b.bytes => Err(if b.quota {
                TableError::Quota(format!(
                    "the table passed your remaining quota of {} bytes while it was converted; \
                     delete some tables first",
                    b.bytes
                ))
            } else {
                TableError::TooLarge(format!(
                    "the table passed the limit of {} bytes per stored table while it was \
                     converted; upload less (fewer rows or columns)",
                    b.bytes
                ))
            }),
            _ => Ok(()),
        }
    };
    let mut writer: Option<
        arrow_ipc::writer::FileWriter<Counting<std::io::BufWriter<std::fs::File>>>,
    > = None;
    let mut out_schema: Option<SchemaRef> = None;
    let mut rows = 0u64;
    for b in batches {
        let b = b.map_err(|e| TableError::Invalid(format!("the table could not be read: {e}")))?;
        let mut cols = Vec::with_capacity(b.num_columns());
        for (i, f) in schema.fields().iter().enumerate() {
            let mut c = normalise(f.name(), b.column(i))?;
            if format == TableFormat::Json {
                c = coerce_dates(c);
            }
            cols.push(c);
        }
        let s = out_schema.get_or_insert_with(|| {
            Arc::new(Schema::new(
                schema
                    .fields()
                    .iter()
                    .zip(&cols)
                    .map(|(f, c)| Field::new(f.name(), c.data_type().clone(), true))
                    .collect::<Vec<_>>(),
            ))
        });
        // Later batches must agree with the first (JSON date coercion is per batch).
        let cols = cols
            .into_iter()
            .zip(s.fields())
            .map(|(c, f)| {
                if c.data_type() == f.data_type() {
                    Ok(c)
                } else {
                    arrow_cast::cast(&c, f.data_type())
                }
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TableError::Invalid(format!("columns changed type between rows: {e}")))?;
        let batch = RecordBatch::try_new(s.clone(), cols)
            .map_err(|e| TableError::Invalid(e.to_string()))?;
        if writer.is_none() {
            let file = Counting {
                inner: std::io::BufWriter::new(std::fs::File::create(&tmp)?),
                written: written.clone(),
            };
            writer = Some(
                arrow_ipc::writer::FileWriter::try_new(file, s)
                    .map_err(|e| TableError::Invalid(e.to_string()))?,
            );
        }
        if let Some(w) = writer.as_mut() {
            rows += batch.num_rows() as u64;
            w.write(&batch)
                .map_err(|e| TableError::Invalid(e.to_string()))?;
        }
        over(written.load(std::sync::atomic::Ordering::Relaxed))?;
    }
    let schema = out_schema.unwrap_or_else(|| {
        Arc::new(Schema::new(
            schema
                .fields()
                .iter()
                .map(|f| Field::new(f.name(), normalise_type(f.data_type()), true))
                .collect::<Vec<_>>(),
        ))
    });
    let mut columns = Vec::new();
    for f in schema.fields() {
        let kind = kind_of(f.data_type()).ok_or_else(|| {
            TableError::Invalid(format!("column {:?} has an unsupported type", f.name()))
        })?;
        columns.push(ColumnMeta {
            name: f.name().clone(),
            kind: kind.into(),
        });
    }
    let mut w = match writer {
        Some(w) => w,
        None => {
            let file = Counting {
                inner: std::io::BufWriter::new(std::fs::File::create(&tmp)?),
                written: written.clone(),
            };
            arrow_ipc::writer::FileWriter::try_new(file, &schema)
                .map_err(|e| TableError::Invalid(e.to_string()))?
        }
    };
    w.finish().map_err(|e| TableError::Invalid(e.to_string()))?;
    let mut file = w
        .into_inner()
        .map_err(|e| TableError::Invalid(e.to_string()))?;
    file.flush()?;
    drop(file);
    over(written.load(std::sync::atomic::Ordering::Relaxed))?;
    std::fs::rename(&tmp, path)?;
    Ok((rows, columns))
}

fn normalise_type(t: &DataType) -> DataType {
    match t {
        DataType::Int64
        | DataType::Float64
        | DataType::Boolean
        | DataType::Utf8
        | DataType::Date32 => t.clone(),
        DataType::Timestamp(_, tz) => DataType::Timestamp(TimeUnit::Microsecond, tz.clone()),
        _ => DataType::Utf8,
    }
}

/// The tables of every tenant. Index entries and Arrow files live in the
/// shared [`BlobStore`] (`tables/{tenant}/{pointer}.json` and `.arrow`), so
/// a table uploaded on one node resolves on every node of the store; each
/// node keeps the files it used in a local cache (`{dir}/cache`) and hands
/// the cached file to the worker. An index entry never changes once
/// written, so a node may keep it in memory; whether it still exists
/// (deleted on another node) is asked of the store on every use.
#[derive(Debug)]
pub struct TableStore {
    cfg: TableConfig,
    store: BlobStore,
    /// Index entries read so far, by pointer (immutable once written).
    metas: Mutex<HashMap<String, TableMeta>>,
    /// When the whole store was last swept for expired tables.
    swept: Mutex<Option<std::time::Instant>>,
    /// Conversions running now (at most `max_conversions`), and the
    /// uploads waiting for a turn.
    converting: Mutex<usize>,
    turn: std::sync::Condvar,
}

/// A conversion slot, given back on drop (waking one waiting upload).
struct Slot<'a>(&'a TableStore);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        *self.0.converting.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.0.turn.notify_one();
    }
}

/// How often a node sweeps the whole store for expired tables (each
/// tenant's own are also dropped whenever its tables are listed).
const SWEEP_EVERY: Duration = Duration::from_secs(600);

use crate::blob::tenant_key;

fn store_err(e: BlobError) -> TableError {
    TableError::Io(std::io::Error::other(e.to_string()))
}

impl TableStore {
    /// Opens (or creates) the data directory and the store (`cfg.store`,
    /// else `{dir}/store`); expired tables and stray files are removed. A
    /// data directory of the earlier layout (`index.json` beside the
    /// Arrow files) is moved into the store once.
    pub fn open(cfg: TableConfig) -> Result<Self, std::io::Error> {
        std::fs::create_dir_all(cfg.dir.join("cache"))?;
        let url = cfg
            .store
            .clone()
            .unwrap_or_else(|| StoreUrl::Local(cfg.dir.join("store")));
        let store = BlobStore::open(&url).map_err(|e| std::io::Error::other(e.to_string()))?;
        Self::with_store(cfg, store)
    }

    /// A table store over `store` (tests; a store shared in memory).
    pub fn with_store(cfg: TableConfig, store: BlobStore) -> Result<Self, std::io::Error> {
        std::fs::create_dir_all(cfg.dir.join("cache"))?;
        let s = Self {
            cfg,
            store,
            metas: Mutex::new(HashMap::new()),
            swept: Mutex::new(None),
            converting: Mutex::new(0),
            turn: std::sync::Condvar::new(),
        };
        s.migrate_old_index()?;
        s.sweep();
        Ok(s)
    }

    /// The configuration.
    pub fn config(&self) -> &TableConfig {
        &self.cfg
    }

    /// The shared store (readiness asks it whether it answers).
    pub fn store(&self) -> &BlobStore {
        &self.store
    }

    fn cached(&self, pointer: &str) -> PathBuf {
        self.cfg.dir.join("cache").join(format!("{pointer}.arrow"))
    }

    fn meta_key(tenant: &str, pointer: &str) -> String {
        format!("tables/{}/{pointer}.json", tenant_key(tenant))
    }

    fn file_key(tenant: &str, pointer: &str) -> String {
        format!("tables/{}/{pointer}.arrow", tenant_key(tenant))
    }

    /// Moves tables of the one-node layout (before the shared store) in.
    fn migrate_old_index(&self) -> std::io::Result<()> {
        let old = self.cfg.dir.join("index.json");
        let Ok(bytes) = std::fs::read(&old) else {
            return Ok(());
        };
        let index: HashMap<String, TableMeta> = serde_json::from_slice(&bytes).unwrap_or_default();
        for (p, m) in index {
            let file = self.cfg.dir.join(format!("{p}.arrow"));
            if m.expires_unix > unix_now() && file.is_file() {
                self.store
                    .put_file(&Self::file_key(&m.tenant, &p), &file)
                    .and_then(|()| {
                        self.store.put(
                            &Self::meta_key(&m.tenant, &p),
                            serde_json::to_vec(&m).unwrap_or_default(),
                        )
                    })
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                std::fs::rename(&file, self.cached(&p))?;
            } else {
                let _ = std::fs::remove_file(&file);
            }
        }
        std::fs::rename(&old, self.cfg.dir.join("index.json.migrated"))
    }

    /// Reads the index entry of `pointer` of `tenant` (memory, else the
    /// store); `None` if the store has none.
    fn meta(
        &self,
        tenant: &str,
        pointer: &str,
        known: bool,
    ) -> Result<Option<TableMeta>, BlobError> {
        if known {
            if let Some(m) = self
                .metas
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(pointer)
            {
                return Ok(Some(m.clone()));
            }
        }
        let Some(b) = self.store.get(&Self::meta_key(tenant, pointer))? else {
            self.metas
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(pointer);
            return Ok(None);
        };
        let Ok(m) = serde_json::from_slice::<TableMeta>(&b.bytes) else {
            return Ok(None);
        };
        if m.tenant != tenant || m.data_pointer != pointer {
            return Ok(None);
        }
        self.metas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(pointer.to_string(), m.clone());
        Ok(Some(m))
    }

    /// Removes a table from the store, the memory and the cache.
    fn remove(&self, tenant: &str, pointer: &str) {
        let _ = self.store.delete(&Self::meta_key(tenant, pointer));
        let _ = self.store.delete(&Self::file_key(tenant, pointer));
        self.metas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(pointer);
        let _ = std::fs::remove_file(self.cached(pointer));
    }

    /// The live tables of `tenant` (expired ones are removed on the way).
    fn tenant_tables(&self, tenant: &str) -> Result<Vec<TableMeta>, BlobError> {
        let listed = self.store.list(&format!("tables/{}", tenant_key(tenant)))?;
        let now = unix_now();
        let mut out = Vec::new();
        for o in listed {
            let Some(name) = o.key.rsplit('/').next() else {
                continue;
            };
            let Some(pointer) = name.strip_suffix(".json") else {
                continue;
            };
            match self.meta(tenant, pointer, true)? {
                Some(m) if m.expires_unix > now => out.push(m),
                Some(_) => self.remove(tenant, pointer),
                None => {}
            }
        }
        Ok(out)
    }

    /// Removes expired tables and stray files: the whole store at most
    /// every few minutes, the local directory every time.
    pub fn sweep(&self) {
        let now = unix_now();
        let due = {
            let mut s = self.swept.lock().unwrap_or_else(|e| e.into_inner());
            let due = s.is_none_or(|t| t.elapsed() >= SWEEP_EVERY);
            if due {
                *s = Some(std::time::Instant::now());
            }
            due
        };
        if due {
            if let Ok(all) = self.store.list("tables") {
                let metas: std::collections::HashSet<&str> = all
                    .iter()
                    .filter_map(|o| o.key.strip_suffix(".json"))
                    .collect();
                for o in &all {
                    let mut parts = o.key.split('/');
                    let (Some(_), Some(tk), Some(name)) =
                        (parts.next(), parts.next(), parts.next())
                    else {
                        continue;
                    };
                    let tenant = tenant_from_key(tk);
                    if let Some(p) = name.strip_suffix(".json") {
                        if let Ok(Some(m)) = self.meta(&tenant, p, true) {
                            if m.expires_unix <= now {
                                self.remove(&tenant, p);
                            }
                        }
                    } else if let Some(stem) = o.key.strip_suffix(".arrow") {
                        // An Arrow file without its entry an hour after it
                        // was written: an upload whose node died midway.
                        let old = o.modified_unix.is_some_and(|t| t + 3600 < now);
                        if !metas.contains(stem) && old {
                            let _ = self.store.delete(&o.key);
                        }
                    }
                }
            }
        }
        let hour = Duration::from_secs(3600);
        let age = |e: &std::fs::DirEntry| {
            e.metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
        };
        if let Ok(entries) = std::fs::read_dir(&self.cfg.dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                // A stray file is removed once it is an hour old: younger
                // ones may be an upload in progress.
                if (name.ends_with(".part") || name.ends_with(".tmp") || name.ends_with(".ndjson"))
                    && age(&e).is_some_and(|a| a > hour)
                {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        // A cached file outlives no pointer: pointers live `ttl`.
        if let Ok(entries) = std::fs::read_dir(self.cfg.dir.join("cache")) {
            for e in entries.flatten() {
                let a = age(&e);
                let name = e.file_name().to_string_lossy().into_owned();
                let stale = if name.ends_with(".arrow") {
                    a.is_some_and(|a| a > self.cfg.ttl)
                } else {
                    a.is_some_and(|a| a > hour)
                };
                if stale {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    /// Stores a table for `tenant` from bytes in memory (small uploads:
    /// nng messages, tests). The bytes are spooled to a file first, so the
    /// conversion is the same bounded one as [`TableStore::put_file`].
    pub fn put(
        &self,
        tenant: &str,
        format: TableFormat,
        bytes: &[u8],
    ) -> Result<TableMeta, TableError> {
        let spool = self.spool_path();
        std::fs::write(&spool, bytes)?;
        let r = self.put_file(tenant, format, &spool);
        let _ = std::fs::remove_file(&spool);
        r
    }

    /// Waits (at most `conversion_wait`) until fewer than
    /// `max_conversions` conversions run, and takes a slot.
    fn take_turn(&self) -> Result<Slot<'_>, TableError> {
        let max = self.cfg.max_conversions.max(1);
        let until = std::time::Instant::now() + self.cfg.conversion_wait;
        let mut n = self.converting.lock().unwrap_or_else(|e| e.into_inner());
        while *n >= max {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(TableError::Busy(format!(
                    "{} tables are being converted now, the most at once, and this one waited {} s \
                     for its turn; retry in a moment",
                    *n,
                    self.cfg.conversion_wait.as_secs()
                )));
            }
            n = self
                .turn
                .wait_timeout(n, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *n += 1;
        Ok(Slot(self))
    }

    /// A fresh path in the data directory for an upload on its way in
    /// (removed by the caller; stray ones by [`TableStore::sweep`]).
    pub fn spool_path(&self) -> PathBuf {
        self.cfg
            .dir
            .join(format!("upload-{}.part", rvisor::ids::random_hex(8)))
    }

    /// Stores the upload in file `src` as a table of `tenant`, converting
    /// it batch by batch in bounded memory. The tenant's table count and
    /// quota are checked before, and the quota and the per-table limit
    /// while the output grows: a conversion stops as soon as it passes
    /// either. At most `max_conversions` run at once; more are `Busy`.
    /// The converted file goes to the shared store (in parts), then its
    /// index entry; the node keeps the file in its cache.
    pub fn put_file(
        &self,
        tenant: &str,
        format: TableFormat,
        src: &Path,
    ) -> Result<TableMeta, TableError> {
        self.sweep();
        let used = {
            let mine = self.tenant_tables(tenant).map_err(store_err)?;
            if mine.len() >= self.cfg.max_tables_per_tenant {
                return Err(TableError::Quota(format!(
                    "you have {} tables, the most allowed; delete some (DELETE /v1/tables/{{pointer}})",
                    mine.len()
                )));
            }
            let used: u64 = mine.iter().map(|m| m.bytes).sum();
            if used >= self.cfg.max_bytes_per_tenant {
                return Err(TableError::Quota(format!(
                    "your tables use {used} bytes of {}; delete some first",
                    self.cfg.max_bytes_per_tenant
                )));
            }
            used
        };
        let _slot = self.take_turn()?;
        let remaining = self.cfg.max_bytes_per_tenant.saturating_sub(used);
        let budget = if remaining < self.cfg.max_stored_bytes_per_table {
            Budget {
                bytes: remaining,
                quota: true,
            }
        } else {
            Budget {
                bytes: self.cfg.max_stored_bytes_per_table,
                quota: false,
            }
        };
        let pointer = format!("dp_{}", rvisor::ids::random_hex(24));
        let path = self.cached(&pointer);
        let (rows, columns) = convert(format, src, &path, Some(budget))?;
        let stored = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let expires = unix_now() + self.cfg.ttl.as_secs();
        let meta = TableMeta {
            data_pointer: pointer.clone(),
            rows,
            columns,
            expires_at: rfc3339(expires),
            bytes: stored,
            tenant: tenant.to_string(),
            expires_unix: expires,
        };
        let fail = |e: TableError| {
            let _ = std::fs::remove_file(&path);
            let _ = self.store.delete(&Self::file_key(tenant, &pointer));
            e
        };
        // Another upload of the tenant (on any node) may have finished
        // meanwhile.
        let used: u64 = self
            .tenant_tables(tenant)
            .map_err(|e| fail(store_err(e)))?
            .iter()
            .map(|m| m.bytes)
            .sum();
        if used + stored > self.cfg.max_bytes_per_tenant {
            return Err(fail(TableError::Quota(format!(
                "this table ({stored} bytes stored) would take your tables over {} bytes; delete some first",
                self.cfg.max_bytes_per_tenant
            ))));
        }
        // The file first, then the entry that makes it visible.
        self.store
            .put_file(&Self::file_key(tenant, &pointer), &path)
            .map_err(|e| fail(store_err(e)))?;
        self.store
            .put_if_absent(
                &Self::meta_key(tenant, &pointer),
                serde_json::to_vec(&meta).unwrap_or_default(),
            )
            .map_err(|e| fail(store_err(e)))?;
        self.metas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(pointer, meta.clone());
        Ok(public(meta))
    }

    /// How many tables `tenant` keeps and the bytes they take.
    pub fn usage(&self, tenant: &str) -> (usize, u64) {
        self.tenant_tables(tenant)
            .unwrap_or_default()
            .iter()
            .fold((0, 0), |(n, b), m| (n + 1, b + m.bytes))
    }

    /// The table behind `pointer`, if `tenant` owns it and it has not
    /// expired. Another tenant's pointer looks exactly like an unknown one.
    pub fn get(&self, tenant: &str, pointer: &str) -> Option<TableMeta> {
        self.lookup(tenant, pointer).ok().flatten().map(public)
    }

    /// `get` with the store's failures (logged by callers that must not
    /// say why a pointer did not resolve).
    fn lookup(&self, tenant: &str, pointer: &str) -> Result<Option<TableMeta>, BlobError> {
        // Pointers are ours to make: anything else is no key to ask for.
        if !pointer.starts_with("dp_") || !pointer[3..].bytes().all(|c| c.is_ascii_hexdigit()) {
            return Ok(None);
        }
        let known = self
            .metas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(pointer);
        // Known here: still in the store (not deleted on another node)?
        if known && self.store.head(&Self::meta_key(tenant, pointer))?.is_none() {
            self.metas
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(pointer);
            let _ = std::fs::remove_file(self.cached(pointer));
            return Ok(None);
        }
        match self.meta(tenant, pointer, known)? {
            Some(m) if m.expires_unix > unix_now() => Ok(Some(m)),
            Some(_) => {
                self.remove(tenant, pointer);
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// Deletes a table; false if `tenant` has no such table.
    pub fn delete(&self, tenant: &str, pointer: &str) -> bool {
        if self.get(tenant, pointer).is_none() {
            return false;
        }
        self.remove(tenant, pointer);
        true
    }

    /// The local files of all `pointers` for `tenant` (fetched from the
    /// store into this node's cache when not there yet), or None if any
    /// does not resolve (the caller must not say which).
    pub fn resolve(&self, tenant: &str, pointers: &[&str]) -> Option<Vec<PathBuf>> {
        pointers
            .iter()
            .map(|p| {
                let found = self.lookup(tenant, p).and_then(|m| {
                    let Some(_) = m else { return Ok(None) };
                    let file = self.cached(p);
                    if file.is_file() {
                        return Ok(Some(file));
                    }
                    Ok(self
                        .store
                        .get_to_file(&Self::file_key(tenant, p), &file)?
                        .then_some(file))
                });
                found
                    .map_err(|e| {
                        tracing::warn!(target: "rvisor::tables", pointer = %p, "the store failed: {e}");
                    })
                    .ok()
                    .flatten()
            })
            .collect()
    }
}

/// The tenant a store key component names (see [`tenant_key`]).
fn tenant_from_key(k: &str) -> String {
    let bytes: Vec<u8> = (0..k.len() / 2)
        .filter_map(|i| u8::from_str_radix(k.get(2 * i..2 * i + 2)?, 16).ok())
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn public(mut m: TableMeta) -> TableMeta {
    m.tenant.clear();
    m.expires_unix = 0;
    m
}

/// Converts the upload in file `src` to the Arrow IPC file `path` (bounded
/// memory, no quota), for the CLI's `--table NAME=FILE.csv`.
pub fn convert_file(
    format: TableFormat,
    src: &Path,
    path: &Path,
) -> Result<(u64, Vec<ColumnMeta>), TableError> {
    convert(format, src, path, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (TableStore, PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("rvisor-tables-test-{}", rvisor::ids::random_hex(6)));
        let s = TableStore::open(TableConfig {
            dir: dir.clone(),
            ..TableConfig::default()
        })
        .unwrap();
        (s, dir)
    }

    fn store_with(cfg: impl FnOnce(&mut TableConfig)) -> (TableStore, PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("rvisor-tables-test-{}", rvisor::ids::random_hex(6)));
        let mut c = TableConfig {
            dir: dir.clone(),
            ..TableConfig::default()
        };
        cfg(&mut c);
        (TableStore::open(c).unwrap(), dir)
    }

    /// A CSV of `rows` rows (about 40 bytes each).
    fn big_csv(rows: usize) -> Vec<u8> {
        let mut out = b"id,name,value,day\n".to_vec();
        for i in 0..rows {
            out.extend_from_slice(format!("{i},name-{i},{}.5,2024-01-02\n", i % 977).as_bytes());
        }
        out
    }

    /// Files left in the data directory and its cache, and objects in
    /// the store, besides the stored tables' own.
    fn leftovers(dir: &Path) -> Vec<String> {
        let files = |d: PathBuf| -> Vec<String> {
            std::fs::read_dir(d)
                .map(|r| {
                    r.flatten()
                        .filter(|e| e.path().is_file())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut out = files(dir.to_path_buf());
        out.extend(files(dir.join("cache")));
        out
    }

    #[test]
    fn a_conversion_stops_at_the_tenants_remaining_quota_and_leaves_nothing() {
        let (s, dir) = store_with(|c| c.max_bytes_per_tenant = 1 << 20);
        // ~4 MB of CSV: its Arrow file passes 1 MiB long before the end.
        let e = s.put("t", TableFormat::Csv, &big_csv(100_000)).unwrap_err();
        assert!(matches!(e, TableError::Quota(_)), "{e}");
        assert!(e.to_string().contains("remaining quota"), "{e}");
        assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
        // A small table still fits.
        assert!(s.put("t", TableFormat::Csv, b"a\n1\n").is_ok());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_table_over_the_per_table_limit_is_too_large() {
        let (s, dir) = store_with(|c| c.max_stored_bytes_per_table = 256 << 10);
        let e = s.put("t", TableFormat::Csv, &big_csv(50_000)).unwrap_err();
        assert!(matches!(e, TableError::TooLarge(_)), "{e}");
        assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn conversions_beyond_the_limit_wait_their_turn_then_are_busy() {
        let (s, dir) = store_with(|c| {
            c.max_conversions = 1;
            c.conversion_wait = Duration::ZERO;
        });
        let held = s.take_turn().unwrap();
        let e = s.put("t", TableFormat::Csv, b"a\n1\n").unwrap_err();
        assert!(matches!(e, TableError::Busy(_)), "{e}");
        drop(held);
        assert!(s.put("t", TableFormat::Csv, b"a\n1\n").is_ok());
        let _ = std::fs::remove_dir_all(dir);
        // With time to wait, an upload gets the slot when the holder ends.
        let (s, dir) = store_with(|c| c.max_conversions = 1);
        let s = Arc::new(s);
        let held = s.take_turn().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let s = s.clone();
            std::thread::spawn(move || {
                tx.send(()).unwrap();
                s.put("t", TableFormat::Csv, b"a\n1\n").map(|m| m.rows)
            })
        };
        rx.recv().unwrap();
        drop(held);
        assert_eq!(waiter.join().unwrap().unwrap(), 1);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_json_array_streams_record_by_record_and_refuses_non_records() {
        let (s, dir) = store();
        let mut body = b"[".to_vec();
        for i in 0..70_000 {
            if i > 0 {
                body.push(b',');
            }
            body.extend_from_slice(format!("{{\"i\": {i}, \"s\": \"v{i}\"}}").as_bytes());
        }
        body.push(b']');
        let m = s.put("t", TableFormat::Json, &body).unwrap();
        assert_eq!(m.rows, 70_000);
        for bad in [
            &b"[1, 2]"[..],
            b"[{\"a\": 1}, {}]",
            b"[{ }]",
            b"{\"a\": 1}",
            b"[{\"a\": 1}",
            b"[{\"a\": 1}] x",
        ] {
            let e = s.put("t", TableFormat::Json, bad).unwrap_err();
            assert!(matches!(e, TableError::Invalid(_)), "{e}");
        }
        assert_eq!(leftovers(&dir).len(), 1, "{:?}", leftovers(&dir));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn json_records_of_any_kinds_are_a_table() {
        // What the request schema allows (flat records, scalar values) is
        // stored: a key of several kinds becomes a string column, also when
        // the other kind comes late; a key that is only ever null, and
        // keys some records lack, are columns of missing values.
        let (s, dir) = store();
        let mut body = String::from("[");
        for i in 0..20_000 {
            body.push_str(&format!("{{\"k\": {i}, \"n\": null}},"));
        }
        body.push_str(r#"{"k": "late", "": true, "b": 1.5}, {"k": false, "": "x", "b": true}]"#);
        let m = s.put("t", TableFormat::Json, body.as_bytes()).unwrap();
        assert_eq!(m.rows, 20_002);
        let kinds: Vec<(&str, &str)> = m
            .columns
            .iter()
            .map(|c| (c.name.as_str(), c.kind.as_str()))
            .collect();
        assert!(kinds.contains(&("k", "string")), "{kinds:?}");
        assert!(kinds.contains(&("", "string")), "{kinds:?}");
        assert!(kinds.contains(&("b", "string")), "{kinds:?}");
        assert!(kinds.iter().any(|(n, _)| *n == "n"), "{kinds:?}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn csv_types_are_inferred_with_missing_values() {
        let (s, dir) = store();
        let csv = "i,d,b,s,dt,ts\n1,1.5,true,a,2024-01-02,2024-01-02T03:04:05\nNA,,false,,2024-02-03,\n3,2.5,NA,c,,2024-03-04T05:06:07\n";
        let m = s.put("t1", TableFormat::Csv, csv.as_bytes()).unwrap();
        let kinds: Vec<&str> = m.columns.iter().map(|c| c.kind.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "integer",
                "double",
                "logical",
                "string",
                "date",
                "timestamp"
            ]
        );
        assert_eq!(m.rows, 3);
        assert!(m.data_pointer.starts_with("dp_") && m.data_pointer.len() > 40);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn json_records_and_tenant_isolation() {
        let (s, dir) = store();
        let m = s
            .put("alice", TableFormat::Json, br#"[{"n": 1, "x": 2.5, "day": "2024-01-01", "ok": true, "s": null}, {"n": 2, "x": null, "day": "2024-01-02", "ok": false, "s": "b"}]"#)
            .unwrap();
        let kinds: Vec<(&str, &str)> = m
            .columns
            .iter()
            .map(|c| (c.name.as_str(), c.kind.as_str()))
            .collect();
        assert!(
            kinds.contains(&("n", "integer"))
                && kinds.contains(&("day", "date"))
                && kinds.contains(&("ok", "logical")),
            "{kinds:?}"
        );
        assert!(s.get("alice", &m.data_pointer).is_some());
        assert!(s.get("bob", &m.data_pointer).is_none());
        assert!(s.resolve("bob", &[&m.data_pointer]).is_none());
        assert!(!s.delete("bob", &m.data_pointer));
        assert!(s.delete("alice", &m.data_pointer));
        assert!(s.get("alice", &m.data_pointer).is_none());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn index_survives_a_reopen_and_quota_holds() {
        let dir =
            std::env::temp_dir().join(format!("rvisor-tables-test-{}", rvisor::ids::random_hex(6)));
        let cfg = TableConfig {
            dir: dir.clone(),
            max_tables_per_tenant: 1,
            ..TableConfig::default()
        };
        let s = TableStore::open(cfg.clone()).unwrap();
        let m = s.put("t", TableFormat::Csv, b"a\n1\n").unwrap();
        assert!(matches!(
            s.put("t", TableFormat::Csv, b"a\n1\n"),
            Err(TableError::Quota(_))
        ));
        drop(s);
        let s = TableStore::open(cfg).unwrap();
        assert_eq!(s.get("t", &m.data_pointer).map(|x| x.rows), Some(1));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn an_arrow_stream_is_normalised() {
        use arrow_array::{
            BooleanArray, Date32Array, Float32Array, Int32Array, StringArray,
            TimestampMillisecondArray,
        };
        let (s, dir) = store();
        let schema = Arc::new(Schema::new(vec![
            Field::new("i", DataType::Int32, true),
            Field::new("f", DataType::Float32, true),
            Field::new("s", DataType::Utf8, true),
            Field::new("d", DataType::Date32, true),
            Field::new(
                "t",
                DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
                true,
            ),
            Field::new("b", DataType::Boolean, true),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int32Array::from(vec![Some(1), None])),
                Arc::new(Float32Array::from(vec![Some(1.5), None])),
                Arc::new(StringArray::from(vec![Some("a"), None])),
                Arc::new(Date32Array::from(vec![Some(19000), None])),
                Arc::new(
                    TimestampMillisecondArray::from(vec![Some(1_700_000_000_000), None])
                        .with_timezone("UTC"),
                ),
                Arc::new(BooleanArray::from(vec![Some(true), None])),
            ],
        )
        .unwrap();
        let mut bytes = Vec::new();
        {
            let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut bytes, &schema).unwrap();
            w.write(&batch).unwrap();
            w.finish().unwrap();
        }
        let m = s.put("t", TableFormat::ArrowStream, &bytes).unwrap();
        let kinds: Vec<&str> = m.columns.iter().map(|c| c.kind.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "integer",
                "double",
                "string",
                "date",
                "timestamp",
                "logical"
            ]
        );
        assert_eq!(m.rows, 2);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_table_stored_on_one_node_resolves_on_another_sharing_the_store() {
        let shared =
            std::env::temp_dir().join(format!("rvisor-shared-{}", rvisor::ids::random_hex(6)));
        let node = |quota_tables: usize| {
            let dir = std::env::temp_dir()
                .join(format!("rvisor-tables-test-{}", rvisor::ids::random_hex(6)));
            let s = TableStore::open(TableConfig {
                dir: dir.clone(),
                store: Some(StoreUrl::Local(shared.clone())),
                max_tables_per_tenant: quota_tables,
                ..TableConfig::default()
            })
            .unwrap();
            (s, dir)
        };
        let (a, dir_a) = node(2);
        let (b, dir_b) = node(2);
        let m = a.put("t", TableFormat::Csv, b"x,y\n1,a\n2,b\n").unwrap();
        // B has never seen it: the entry and the file come from the store.
        assert_eq!(b.get("t", &m.data_pointer).map(|x| x.rows), Some(2));
        assert!(b.get("other", &m.data_pointer).is_none());
        assert!(b.resolve("other", &[&m.data_pointer]).is_none());
        let files = b.resolve("t", &[&m.data_pointer]).unwrap();
        assert!(files[0].starts_with(dir_b.join("cache")), "{files:?}");
        assert_eq!(
            std::fs::read(&files[0]).unwrap(),
            std::fs::read(a.cached(&m.data_pointer)).unwrap()
        );
        // The quota counts the tenant's tables of every node.
        b.put("t", TableFormat::Csv, b"x\n1\n").unwrap();
        assert!(matches!(
            a.put("t", TableFormat::Csv, b"x\n1\n"),
            Err(TableError::Quota(_))
        ));
        // Deleted on B: gone on A too, though A had it in memory and cache.
        assert!(b.delete("t", &m.data_pointer));
        assert!(a.get("t", &m.data_pointer).is_none());
        assert!(a.resolve("t", &[&m.data_pointer]).is_none());
        assert!(!a.cached(&m.data_pointer).exists());
        for d in [dir_a, dir_b, shared] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn tables_of_the_one_node_layout_move_into_the_store() {
        let dir =
            std::env::temp_dir().join(format!("rvisor-tables-test-{}", rvisor::ids::random_hex(6)));
        std::fs::create_dir_all(&dir).unwrap();
        let arrow = dir.join("dp_00ff.arrow");
        convert_file(
            TableFormat::Csv,
            &{
                let src = dir.join("src.csv");
                std::fs::write(&src, "a\n1\n").unwrap();
                src
            },
            &arrow,
        )
        .unwrap();
        let meta = TableMeta {
            data_pointer: "dp_00ff".into(),
            rows: 1,
            columns: vec![],
            expires_at: String::new(),
            bytes: 10,
            tenant: "t".into(),
            expires_unix: unix_now() + 60,
        };
        std::fs::write(
            dir.join("index.json"),
            serde_json::to_vec(&HashMap::from([("dp_00ff".to_string(), meta)])).unwrap(),
        )
        .unwrap();
        let s = TableStore::open(TableConfig {
            dir: dir.clone(),
            ..TableConfig::default()
        })
        .unwrap();
        assert_eq!(s.get("t", "dp_00ff").map(|m| m.rows), Some(1));
        assert!(s.resolve("t", &["dp_00ff"]).is_some());
        assert!(!dir.join("index.json").exists() && !arrow.exists());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        let (s, dir) = store();
        assert!(matches!(
            s.put("t", TableFormat::Json, b"{\"a\": 1}"),
            Err(TableError::Invalid(_))
        ));
        assert!(matches!(
            s.put("t", TableFormat::ArrowStream, b"nope"),
            Err(TableError::Invalid(_))
        ));
        let _ = std::fs::remove_dir_all(dir);
    }
}
