//! `flumen.*` settings: a DataFusion config extension, settable with `SET flumen.x = ...`.

use std::fmt;
use std::str::FromStr;

use datafusion::common::config::ConfigExtension;
use datafusion::common::config::{ConfigEntry, ConfigField, ExtensionOptions, Visit};
use datafusion::common::config_field;
use datafusion::error::DataFusionError;

/// How the scheduler runs a query's operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExecMode {
    /// Streaming batch execution: every operator may run at once, under the memory budget.
    #[default]
    Streaming,
    /// Stage at a time: one operator runs to completion, materializing every block,
    /// before the next starts (the baseline that benchmarks compare against).
    Batch,
    /// Static placement, as stream processors do: every operator runs at once, but each gets
    /// a fixed share of its pool's slots when the run starts (the CPU slots split evenly over
    /// the CPU operators, the query's output consumer counted as one; every accelerator worker
    /// started up front) and never uses another operator's idle slot.
    Static,
}

impl FromStr for ExecMode {
    type Err = DataFusionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "streaming" => Ok(Self::Streaming),
            "batch" => Ok(Self::Batch),
            "static" => Ok(Self::Static),
            other => Err(DataFusionError::Configuration(format!(
                "flumen.mode must be 'streaming', 'batch' or 'static', got '{other}'"
            ))),
        }
    }
}

impl fmt::Display for ExecMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Streaming => "streaming",
            Self::Batch => "batch",
            Self::Static => "static",
        })
    }
}

config_field!(ExecMode);

/// Where CPU tasks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WorkerMode {
    /// On threads of this process (the embedded default).
    #[default]
    Threads,
    /// Source, block-wise and model tasks in worker processes the session starts
    /// (`flumen worker`: a CPU pool and an accelerator pool), their blocks kept there until
    /// read; a killed or hung worker's blocks are recomputed from lineage.
    Process,
}

impl FromStr for WorkerMode {
    type Err = DataFusionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "threads" | "thread" => Ok(Self::Threads),
            "process" | "processes" => Ok(Self::Process),
            other => Err(DataFusionError::Configuration(format!(
                "flumen.workers must be 'threads' or 'process', got '{other}'"
            ))),
        }
    }
}

impl fmt::Display for WorkerMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Threads => "threads",
            Self::Process => "process",
        })
    }
}

config_field!(WorkerMode);

/// Where model UDFs (`embed`) compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Device {
    /// CUDA when a device is found, else the CPU (with a one-line notice).
    #[default]
    Auto,
    /// Always the CPU.
    Cpu,
    /// Always CUDA; an error when no device is usable.
    Cuda,
}

impl FromStr for Device {
    type Err = DataFusionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda),
            other => Err(DataFusionError::Configuration(format!(
                "flumen.device must be 'auto', 'cpu' or 'cuda', got '{other}'"
            ))),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        })
    }
}

config_field!(Device);

/// The numbers `embed`'s forward pass computes in (`flumen.embed_precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum EmbedPrecision {
    /// fp32 weights and activations throughout.
    #[default]
    Fp32,
    /// bfloat16 weights and stored activations, products summed in fp32 (tensor cores on a
    /// GPU; on the CPU the same rounding is emulated, for the same answers, not for speed).
    /// Output vectors stay fp32 and normalized.
    Bf16,
    /// bf16 on a CUDA device with bf16 tensor cores (compute capability 8.0 or newer), fp32
    /// anywhere else.
    Auto,
}

impl FromStr for EmbedPrecision {
    type Err = DataFusionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Ok(Self::Fp32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "auto" => Ok(Self::Auto),
            other => Err(DataFusionError::Configuration(format!(
                "flumen.embed_precision must be 'fp32', 'bf16' or 'auto', got '{other}'"
            ))),
        }
    }
}

impl fmt::Display for EmbedPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fp32 => "fp32",
            Self::Bf16 => "bf16",
            Self::Auto => "auto",
        })
    }
}

config_field!(EmbedPrecision);

/// Where a model's CPU step (`embed`'s tokenizer) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PreprocessOnCpu {
    /// In the CPU tasks feeding the model when the model computes on an accelerator (a GPU
    /// it would otherwise leave idle while tokenizing); inside the model's worker when the
    /// model computes on the CPU itself, whose threads the step would only contend with.
    #[default]
    Auto,
    /// Always in the CPU tasks feeding the model.
    Always,
    /// Always inside the model's worker.
    Never,
}

impl FromStr for PreprocessOnCpu {
    type Err = DataFusionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "true" | "always" | "on" => Ok(Self::Always),
            "false" | "never" | "off" => Ok(Self::Never),
            other => Err(DataFusionError::Configuration(format!(
                "flumen.preprocess_on_cpu must be 'auto', 'true' or 'false', got '{other}'"
            ))),
        }
    }
}

impl fmt::Display for PreprocessOnCpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Always => "true",
            Self::Never => "false",
        })
    }
}

config_field!(PreprocessOnCpu);

/// Which joins a worker runs are fed their probe side as it is made
/// (`flumen.feed_joins_on_workers`, see [`crate::plan::graph::OperatorGraph::fed_inputs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FeedJoins {
    /// Those whose own output is read as it is made (a `LIMIT` above them, a join on the
    /// driver, a join fed in turn); the others wait for both sides (barriers).
    #[default]
    ReadAsMade,
    /// Every join a worker runs.
    All,
    /// None: every join a worker runs is a barrier.
    Off,
}

impl FromStr for FeedJoins {
    type Err = DataFusionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "true" | "on" | "read_as_made" => Ok(Self::ReadAsMade),
            "all" => Ok(Self::All),
            "false" | "off" => Ok(Self::Off),
            other => Err(DataFusionError::Configuration(format!(
                "flumen.feed_joins_on_workers must be 'true' (joins read as they are made), \
                 'all' or 'false', got '{other}'"
            ))),
        }
    }
}

impl fmt::Display for FeedJoins {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::ReadAsMade => "true",
            Self::All => "all",
            Self::Off => "false",
        })
    }
}

config_field!(FeedJoins);

/// How a worker compresses the blocks it sends over the network to another worker or the
/// driver (`flumen.exchange_compression`): Arrow IPC's own buffer compression, which
/// every reader decodes. A worker reading a block it holds itself never encodes it, and a
/// worker on a loopback address is never asked to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExchangeCompression {
    /// Sent as they are.
    None,
    /// LZ4 frames: cheap to make and to read.
    #[default]
    Lz4,
    /// Zstandard: fewer bytes, more CPU.
    Zstd,
}

impl ExchangeCompression {
    /// Arrow IPC's compression of this choice; `None` for none.
    pub fn ipc(self) -> Option<datafusion::arrow::ipc::CompressionType> {
        use datafusion::arrow::ipc::CompressionType;
        match self {
            Self::None => None,
            Self::Lz4 => Some(CompressionType::LZ4_FRAME),
            Self::Zstd => Some(CompressionType::ZSTD),
        }
    }
}

impl FromStr for ExchangeCompression {
    type Err = DataFusionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "" | "false" | "off" => Ok(Self::None),
            "lz4" => Ok(Self::Lz4),
            "zstd" => Ok(Self::Zstd),
            other => Err(DataFusionError::Configuration(format!(
                "flumen.exchange_compression must be 'none', 'lz4' or 'zstd', got '{other}'"
            ))),
        }
    }
}

impl fmt::Display for ExchangeCompression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Lz4 => "lz4",
            Self::Zstd => "zstd",
        })
    }
}

config_field!(ExchangeCompression);

/// A number of bytes, written as `1073741824`, `512MB`, `2GB` or `1.5GiB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl Default for ByteSize {
    fn default() -> Self {
        ByteSize(2 << 30)
    }
}

impl FromStr for ByteSize {
    type Err = DataFusionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let text = s.trim();
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let bad = || {
            DataFusionError::Configuration(format!(
                "a byte count such as '2GB', '512MiB' or '1000000' was expected, got '{s}'"
            ))
        };
        let value: f64 = number.parse().map_err(|_| bad())?;
        let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kb" | "kib" => 1024.0,
            "m" | "mb" | "mib" => 1024.0 * 1024.0,
            "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
            "t" | "tb" | "tib" => 1024.0f64.powi(4),
            _ => return Err(bad()),
        };
        if !(value.is_finite() && value >= 0.0) {
            return Err(bad());
        }
        Ok(ByteSize((value * scale) as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        if self.0 >= 1 << 30 {
            write!(f, "{:.1}GiB", b / (1u64 << 30) as f64)
        } else if self.0 >= 1 << 20 {
            write!(f, "{:.1}MiB", b / (1u64 << 20) as f64)
        } else {
            write!(f, "{}B", self.0)
        }
    }
}

config_field!(ByteSize);

/// The seed of random shuffles: a number, or none (`''`, `'random'`: each query draws one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShuffleSeed(pub Option<u64>);

impl FromStr for ShuffleSeed {
    type Err = DataFusionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "random" | "none" => Ok(Self(None)),
            n => n.parse::<u64>().map(|v| Self(Some(v))).map_err(|_| {
                DataFusionError::Configuration(format!(
                    "flumen.shuffle_seed must be a number from 0 to {} or '' (a seed per \
                     query), got '{s}'",
                    u64::MAX
                ))
            }),
        }
    }
}

impl fmt::Display for ShuffleSeed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(seed) => write!(f, "{seed}"),
            None => Ok(()),
        }
    }
}

config_field!(ShuffleSeed);

/// The executable worker processes start from: fixed when the session starts
/// (`flumen --worker-binary PATH`, or [`FlumenConfig::worker_binary`] in Rust), never by `SET`,
/// which would let any statement run any program at the next process-mode query.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerBinary(pub String);

impl From<&str> for WorkerBinary {
    fn from(path: &str) -> Self {
        Self(path.to_string())
    }
}

impl From<String> for WorkerBinary {
    fn from(path: String) -> Self {
        Self(path)
    }
}

impl datafusion::common::config::ConfigField for WorkerBinary {
    fn visit<V: datafusion::common::config::Visit>(
        &self,
        v: &mut V,
        key: &str,
        description: &'static str,
    ) {
        v.some(key, &self.0, description)
    }

    /// Refused: DataFusion hands a leaf field an empty `key` (the name is its parent's), so
    /// the message names both fields of this type.
    fn set(&mut self, _key: &str, _value: &str) -> datafusion::error::Result<()> {
        Err(DataFusionError::Configuration(
            "flumen.worker_binary and flumen.worker_module are startup options, not SETs: \
             give them when the session starts (`flumen --worker-binary PATH`, \
             FlumenConfig::worker_binary in Rust; a Python session sets both to run \
             `python -m flumen worker`)"
                .into(),
        ))
    }
}

/// `<cache>/flumen`, where `<cache>` is `$XDG_CACHE_HOME` or `~/.cache` (else the temporary
/// directory): the embedding model, the demo table, kernels compiled for a GPU.
pub fn cache_dir() -> std::path::PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("flumen")
}

/// The number of CPU cores this process may use.
pub fn available_cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
}

/// The error of `SET name = value` (a setting of type `type_name`) as one line that names
/// the setting, what it takes and the value given, in place of DataFusion's "Error parsing
/// 'x' as usize caused by External error: ..." chain. flumen's own kinds of setting name
/// themselves in their errors already.
fn refused_setting(
    name: &str,
    type_name: &str,
    value: &str,
    error: DataFusionError,
) -> DataFusionError {
    let why = match error.find_root() {
        DataFusionError::Configuration(why) => why.clone(),
        DataFusionError::External(cause) => cause.to_string(),
        other => other.to_string(),
    };
    let takes = match type_name {
        "usize" | "u64" | "Option<u64>" | "Option < u64 >" => Some("a whole number (0 or more)"),
        "bool" => Some("true or false"),
        "ByteSize" => Some("a byte count such as '2GB', '512MiB' or '1000000'"),
        _ => None,
    };
    DataFusionError::Configuration(match takes {
        _ if why.contains(name) => why,
        Some(takes) => format!("{name} must be {takes}, got '{value}'"),
        None => format!("{name} = '{value}': {why}"),
    })
}

/// A struct of settings, each with its doc comment and default, as DataFusion's
/// `config_namespace!` makes one (a `ConfigField` that sets, lists and resets each field),
/// but `#[non_exhaustive]` like `extensions_options!`'s: a program outside the crate builds
/// it from its default, so a setting added later breaks no caller.
macro_rules! flumen_settings {
    (
        $(#[doc = $struct_doc:tt])*
        $vis:vis struct $name:ident {
            $(
                $(#[doc = $doc:tt])*
                $field_vis:vis $field:ident : $field_type:ty, default = $default:expr
            )*
        }
    ) => {
        $(#[doc = $struct_doc])*
        #[derive(Debug, Clone)]
        #[non_exhaustive]
        $vis struct $name {
            $(
                $(#[doc = $doc])*
                $field_vis $field: $field_type,
            )*
        }

        impl Default for $name {
            fn default() -> Self {
                Self {
                    $($field: $default),*
                }
            }
        }

        impl ConfigField for $name {
            fn set(&mut self, key: &str, value: &str) -> datafusion::error::Result<()> {
                let (key, rest) = key.split_once('.').unwrap_or((key, ""));
                match key {
                    $(stringify!($field) => self.$field.set(rest, value).map_err(|error| {
                        refused_setting(
                            concat!("flumen.", stringify!($field)),
                            stringify!($field_type),
                            value,
                            error,
                        )
                    }),)*
                    _ => Err(DataFusionError::Configuration(format!(
                        "Config value \"{key}\" not found on {}",
                        stringify!($name)
                    ))),
                }
            }

            fn visit<V: Visit>(&self, v: &mut V, key_prefix: &str, _description: &'static str) {
                $(
                    let key = format!(concat!("{}.", stringify!($field)), key_prefix);
                    self.$field.visit(v, &key, concat!($($doc),*).trim());
                )*
            }

            fn reset(&mut self, key: &str) -> datafusion::error::Result<()> {
                let (key, rest) = key.split_once('.').unwrap_or((key, ""));
                match key {
                    $(
                        stringify!($field) if rest.is_empty() => {
                            self.$field = $default;
                            Ok(())
                        }
                        stringify!($field) => self.$field.reset(rest),
                    )*
                    _ => Err(DataFusionError::Configuration(format!(
                        "Config value \"{key}\" not found on {}",
                        stringify!($name)
                    ))),
                }
            }
        }
    };
}

flumen_settings! {
    /// flumen's settings (`SET flumen.<name> = <value>`). A DataFusion config extension
    /// ([`ConfigExtension`]) whose entries are named with their `flumen.` prefix, so that
    /// `SHOW flumen.<name>`, `SHOW ALL` and `information_schema.df_settings` name them as
    /// `SET` does (DataFusion's `extensions_options!` lists them by their bare names, which
    /// `SHOW` then refuses). Outside this crate it is made from `FlumenConfig::default()`
    /// with fields set: it is `#[non_exhaustive]`, as settings may be added.
    pub struct FlumenConfig {
        /// `streaming` (default), `batch` (one operator at a time, to completion) or `static`
        /// (a fixed share of slots per operator).
        pub mode: ExecMode, default = ExecMode::Streaming
        /// Bytes of blocks the block store keeps in memory; beyond it blocks spill to disk
        /// and producers are held back.
        pub memory_budget: ByteSize, default = ByteSize::default()
        /// Whether the budget also covers heap nobody reserved (readers' buffers, pieces of
        /// blocks not yet cut), when the program installed an allocator that counts its live
        /// bytes (`flumen::install_heap_allocator`; the `flumen` binary does): blocks keep
        /// in memory only what that leaves, but at least a quarter of the budget (and, whatever
        /// operators hold, a sixteenth).
        pub budget_counts_heap: bool, default = true
        /// Whether an out-of-core hash join partition whose build side (a hot key's rows) is
        /// larger than two slices of budget / (4 × CPU slots) is cut into slices of its build
        /// side, run as tasks beside each other, each probed with the whole probe side
        /// (otherwise it runs whole; refused memory: again alone, then as a sort-merge join),
        /// and whether an out-of-core sort's key value holding more than one CPU slot's
        /// share of the rows is spread over several ranges (at most 2 per slot).
        pub slice_hot_partitions: bool, default = true
        /// Whether an out-of-core range sort's ranges are sorted in runs as their blocks
        /// arrive, by tasks that run while the map side still does (a run: what one range
        /// gathers while all ranges' blocks fill half the budget), each range's runs then
        /// merged; `false`: each range is sorted whole by one task once the map side has
        /// finished.
        pub sort_runs: bool, default = true
        /// Directory under which each query makes its spill directory (blocks over the
        /// budget); empty: the system's temp directory (`TMPDIR`).
        pub spill_dir: String, default = String::new()
        /// Tasks that may run at once on the CPU pool.
        pub cpu_slots: usize, default = available_cores()
        /// Most tasks that may run at once on the accelerator pool (workers that keep their
        /// model); the pool grows towards it while accelerator tasks wait. 0 (the default):
        /// one per visible CUDA device where models may use one (`flumen.device` not `cpu`),
        /// else 1 ([`crate::functions::accelerator_devices::accelerator_workers`]).
        pub accelerator_slots: usize, default = 0
        /// Fewest accelerator workers kept alive when idle.
        pub accelerator_min_slots: usize, default = 1
        /// Seconds an accelerator worker waits for work before it exits (down to the minimum).
        pub accelerator_idle_secs: u64, default = 60
        /// Rows per block: larger outputs are split, inputs of accelerator operators are
        /// coalesced up to it.
        pub target_block_rows: usize, default = 8192
        /// With worker processes, most blocks' worth of rows (`target_block_rows` each) a
        /// CPU per-block task (a filter, a projection, a partial aggregate after an
        /// exchange) takes of what its partition has gathered: a task there is a round
        /// trip between processes (~1 ms), more than its work on one block. The first
        /// block goes at once, later ones gather while an earlier task of the partition
        /// runs. 1: a block a task (as in threads mode).
        pub worker_bundle_blocks: usize, default = 8
        /// Whether the tasks of a partitioned hash join's build side sum up their keys
        /// (each key's range and, for at most 4,096 values, their list) where they run,
        /// so the scans of its probe side, which wait for the build side, start from the
        /// bound they make: they prune row groups by it and drop the rows it rejects.
        /// `false`: threads mode prunes by DataFusion's own filter, worker mode only by
        /// an empty build side.
        pub build_key_bounds: bool, default = true
        /// With `build_key_bounds`, whether each task of a join's
        /// build side also makes a set of its keys (a Bloom filter, two bits a key, up to
        /// 1 MiB), which the bound tests its probe rows against where the keys are too many
        /// to list; and whether every scan split of the probe side (not only those under a
        /// grouped aggregate) drops the rows a bound with a list or a set rejects, before
        /// they are exchanged. `false`: lists only, rows dropped under grouped aggregates.
        pub build_key_sets: bool, default = true
        /// With worker processes, which joins a worker runs start once their build side is
        /// complete and are fed their probe side's blocks as they are made: `true`, those
        /// whose own output is read as it is made (a `LIMIT` above them then ends the query
        /// early); `all`, every one; `false`, none. A join not fed starts once both sides
        /// are complete (a barrier, as in Spark or Ballista).
        pub feed_joins_on_workers: FeedJoins, default = FeedJoins::ReadAsMade
        /// With worker processes, whether a semi or anti join with a small build side
        /// (`EXISTS`, `IN`, `NOT EXISTS`) and no condition beyond its keys probes its large
        /// side where that side is made, and exchanges only the build keys it matched
        /// (the build side, a scan under filters and projections, is then read twice);
        /// `false`: its large side is hash exchanged first.
        pub semi_joins_by_key_set: bool, default = true
        /// With worker processes, how a worker compresses the blocks it sends to another
        /// worker or to the driver: `none`, `lz4` or `zstd` (Arrow IPC buffer compression).
        /// `lz4` sends about a third of the bytes for little CPU (less than the network
        /// stack saves, measured); `zstd` half that again for much more CPU. A block read
        /// on the worker that holds it, or fetched from a worker on a loopback address, is
        /// sent as is.
        pub exchange_compression: ExchangeCompression, default = ExchangeCompression::Lz4
        /// With worker processes, most bytes of a task's output that come back to the
        /// driver with the task's reply (its first blocks, while their sum fits), for the
        /// tasks whose output the driver reads (the query's answer), instead of staying in
        /// the worker until the driver fetches them: a small answer then reaches the
        /// driver without another round trip (~0.3 ms a fetch), and is not lost with its
        /// worker. Larger outputs, and every output another worker reads, stay in the
        /// workers. 0: every block stays in its worker.
        pub carried_output_bytes: ByteSize, default = ByteSize(64 * 1024)
        /// Rows of a run's first blocks, in plans with a model UDF: the first splits of each
        /// source partition (one per CPU slot) read batches of this many rows and cut blocks
        /// of this many, then twice as many each time up to `model_piece_rows` (the rest of
        /// the split at that size), and an accelerator operator's first bundles ramp the
        /// same way up to `target_block_rows`, so the first rows come out after a few
        /// dozen rows of work (~200 µs a document of `clean_text` and tokenizing); 0: no
        /// ramp.
        pub first_block_rows: usize, default = 32
        /// The same for plans whose every model computes on CPU threads (`embed` on the
        /// CPU): the ramp starts at the lesser of the two. A CPU forward pass costs tens of
        /// milliseconds a document (MiniLM on two cores: ~25 ms), so a first block of 32
        /// documents held the first row for ~0.8 s; 0: no ramp.
        pub cpu_model_first_block_rows: usize, default = 1
        /// Bytes of a Parquet file a source task reads (its split), so tasks stay small.
        pub split_bytes: ByteSize, default = ByteSize(4 << 20)
        /// Most rows a source task reads in plans with a model UDF (0: no limit): rows there
        /// cost much more CPU than their bytes say (`clean_text`, tokenizing), so splits by
        /// bytes alone would be too few to share the CPU slots out; in such plans row groups
        /// larger than a split (in rows or bytes) are read in pieces (Parquet row
        /// selections). A table with fewer rows than this per CPU slot is cut into one split
        /// per slot (none under `first_block_rows`).
        pub model_split_rows: usize, default = 8192
        /// Most uncompressed bytes (by the files' footers) a source task reads in plans with
        /// a model UDF: CPU functions and models cost by their input's bytes (a document ten
        /// times as long takes ten times as long to clean), so a split of wide rows holds
        /// fewer of them and its block reaches the model as soon as a split of narrow rows
        /// would; 0: rows alone (`model_split_rows`).
        pub model_split_bytes: ByteSize, default = ByteSize(16 << 20)
        /// Most rows a model's operator hands the model at once, and so the most rows of the
        /// blocks it writes (0: `target_block_rows`): its output leaves as the model works
        /// through a bundle, so the next stage (or the query's reader) overlaps with the
        /// device instead of waiting for the whole bundle, and the last bundle's tail after
        /// the device is done stays short.
        pub model_piece_rows: usize, default = 1024
        /// Split size of a scan that feeds a partial aggregate with GROUP BY (at least
        /// `split_bytes`): each task's partial aggregate emits one row per group it saw, so
        /// small splits multiply the rows the final aggregate gets. Not where the files
        /// are clustered by a group column (disjoint min/max per row group).
        pub aggregate_split_bytes: ByteSize, default = ByteSize(256 << 20)
        /// Write each query's task timeline to this file when the query ends (Chrome trace
        /// events: open it in Perfetto or `chrome://tracing`): a bar per task, one row of
        /// bars per lane of the CPU and accelerator pools, with its operator, partition,
        /// rows, blocks and time paused. Each query replaces the file. Empty: no timeline.
        pub timeline_file: String, default = String::new()
        /// Show flumen's operators in `EXPLAIN` (off: DataFusion's own plan text).
        pub explain_operators: bool, default = true
        /// Where model UDFs compute: `auto` (CUDA when present, else CPU), `cpu` or `cuda`.
        pub device: Device, default = Device::Auto
        /// Directory of the embedding model's files; empty: `FLUMEN_MODEL_DIR`, else
        /// `~/.cache/flumen/models/all-MiniLM-L6-v2`.
        pub model_dir: String, default = String::new()
        /// Directory of the model-output cache: a deterministic model's output for an input
        /// it has seen is read from here instead of computed (`functions::model_cache`);
        /// empty (the default for embedded sessions): off. The REPL and `flumen extract`
        /// default to `~/.cache/flumen/model-cache`.
        pub model_cache: String, default = String::new()
        /// Most bytes the model-output cache keeps; the oldest segments go beyond it (0: no
        /// limit).
        pub model_cache_max_bytes: ByteSize, default = ByteSize(10 << 30)
        /// Sentences per forward pass of `embed` (sorted by length inside a block first);
        /// 0 (the default): passes are cut by tokens (`embed_batch_tokens`) instead.
        pub embed_batch_size: usize, default = 0
        /// Most tokens per forward pass of `embed` (a longer sequence runs alone); 0 (the
        /// default): chosen by the worker from measured throughput, among 512 to 8192 on a
        /// CPU and 4096 to 131072 on a GPU (`EXPLAIN ANALYZE` shows the choice). Unused when
        /// `embed_batch_size` is set.
        pub embed_batch_tokens: usize, default = 0
        /// What `embed`'s forward pass computes in: `fp32`, `bf16` (bfloat16 weights and
        /// activations, fp32 sums: tensor cores on a GPU, emulated on the CPU) or `auto`
        /// (bf16 on a CUDA device of compute capability 8.0 or newer, else fp32). bf16
        /// vectors stay within cosine 0.9999 of fp32's on the reference sentences.
        pub embed_precision: EmbedPrecision, default = EmbedPrecision::Fp32
        /// Forward passes of `embed` a worker keeps started on a GPU: 2 (the default) queues
        /// the next pass (its tokens through pinned memory) behind the one computing, so the
        /// device does not wait while the worker collects vectors and packs tokens; 1 waits
        /// for each pass before packing the next. A CPU computes one pass at a time.
        pub embed_passes_in_flight: usize, default = 2
        /// Run a model's CPU step (`embed`'s tokenizer) in the CPU operator feeding the
        /// model, on the CPU pool, instead of in the accelerator worker: `embed(x)` is planned
        /// as `embed(embed_tokens(x))`, `embed_tokens` computed by CPU tasks. `auto` (the
        /// default): when the model's workers occupy an accelerator (CUDA); `true`: always;
        /// `false`: never.
        pub preprocess_on_cpu: PreprocessOnCpu, default = PreprocessOnCpu::Auto
        /// Where tasks run: `threads` (this process) or `process` (worker processes).
        pub workers: WorkerMode, default = WorkerMode::Threads
        /// CPU worker processes a session starts when `flumen.workers = 'process'` (it also
        /// starts `accelerator_slots` accelerator workers). Each runs a task per core. One
        /// (the default, like one Spark or Ballista executor per host) keeps the blocks its
        /// tasks exchange in its own memory; more lose fewer blocks to a crash, but pass
        /// every exchanged block between processes through Flight.
        pub worker_processes: usize, default = 1
        /// The `flumen` executable workers start from; empty: `FLUMEN_WORKER_BIN`, else this
        /// process when it is `flumen`. A startup option: `SET` refuses it.
        pub worker_binary: WorkerBinary, default = WorkerBinary::default()
        /// A Python module workers run as (`<worker_binary> -m MODULE worker ...`, the
        /// binary being Python): how flumen's Python package starts its workers
        /// (`python -m flumen worker`). Empty: the binary is `flumen`. A startup option.
        pub worker_module: WorkerBinary, default = WorkerBinary::default()
        /// Times a task is retried after its worker died (or ran past the task timeout)
        /// before the query fails.
        pub max_task_retries: usize, default = 4
        /// Seconds a task in a worker may go without progress (a block, rows of output, or
        /// work of its operators: a sort or aggregate busy on its input) before the worker
        /// is taken for stuck: it is stopped and the task retried on another one (0: no
        /// limit).
        pub task_timeout_secs: u64, default = 600
        /// Seconds a query may run before it fails with a timeout error (0: no limit).
        pub query_timeout_secs: u64, default = 0
        /// Seconds a worker may leave a heartbeat unanswered before it counts as missed; a
        /// worker that misses two in a row counts as hung and is replaced.
        pub heartbeat_timeout_secs: u64, default = 2
        /// Talk to the workers this session starts on its own host in TLS too (with a
        /// certificate made for this driver); takes effect when a pool starts. Workers on
        /// other hosts always use TLS.
        pub worker_tls: bool, default = false
        /// Workers already running on a cluster's hosts to attach to instead of starting
        /// local ones (with `flumen.workers = 'process'`): `host:port,...`, a cluster file
        /// (`workers.toml`), or `k8s://NAMESPACE/LABEL-SELECTOR`. Empty: local processes.
        pub cluster: String, default = String::new()
        /// With a cluster attached, plan at least one partition per CPU slot its live workers
        /// announced: DataFusion's `target_partitions` counts the driver's cores, so a
        /// 2-core driver of a 48-slot cluster would run each join and aggregate in 2 tasks.
        /// `false`: `target_partitions` alone.
        pub cluster_partitions: bool, default = true
        /// The file holding the cluster's secret (64 hex digits, readable by its owner
        /// only) that its workers were started with.
        pub cluster_secret_file: String, default = String::new()
        /// The CA (PEM file) the cluster workers' certificates chain to; needed for
        /// workers off loopback, which speak TLS only.
        pub worker_ca: String, default = String::new()
        /// Seed of `ORDER BY random()` (a random shuffle): set, the same query gives the same
        /// permutation every run (with the same shuffle partitions, shown in `EXPLAIN`);
        /// `''` (the default), each query draws its own.
        pub shuffle_seed: ShuffleSeed, default = ShuffleSeed::default()
        /// Delta `INSERT INTO`: the application id of an idempotent insert (with
        /// `delta_txn_version`): the insert commits the transaction (app id, version), and
        /// is skipped when the table already has that version of the app or a later one.
        /// Empty: plain inserts.
        pub delta_app_id: String, default = String::new()
        /// Delta `INSERT INTO`: the version of `delta_app_id`'s insert; unset: none.
        pub delta_txn_version: Option<u64>, default = None
        /// Local file output (`COPY`, `INSERT`, `write_*`): flush the staged files and their
        /// directory to disk before the commit renames them, and the target directory
        /// after, so that no committed row is lost to a power cut. Off: faster, and a crash
        /// of the machine may lose what a statement reported written.
        pub output_fsync: bool, default = true
    }
}

impl FlumenConfig {
    /// Rows per block (`flumen.target_block_rows`, at least 1): the one reading of the
    /// target size for every block cut and every bundle.
    pub fn block_rows(&self) -> usize {
        self.target_block_rows.max(1)
    }

    /// These settings with `name` (without `flumen.`) back to its default, as `RESET
    /// flumen.<name>` asks ([`crate::session::reset_flumen_setting`]). An error for a name
    /// that is not a setting, and for the startup options, which no statement changes.
    pub fn with_default(&self, name: &str) -> datafusion::error::Result<FlumenConfig> {
        if name == "worker_binary" || name == "worker_module" {
            // The startup options' own refusal.
            WorkerBinary::default().set("", "")?;
        }
        let mut reset = self.clone();
        ConfigField::reset(&mut reset, name)?;
        Ok(reset)
    }
}

impl ExtensionOptions for FlumenConfig {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    fn cloned(&self) -> Box<dyn ExtensionOptions> {
        Box::new(self.clone())
    }

    fn set(&mut self, key: &str, value: &str) -> datafusion::error::Result<()> {
        ConfigField::set(self, key, value)
    }

    /// Every setting, named `flumen.<name>`.
    fn entries(&self) -> Vec<ConfigEntry> {
        struct Entries(Vec<ConfigEntry>);
        impl Visit for Entries {
            fn some<V: fmt::Display>(&mut self, key: &str, value: V, description: &'static str) {
                self.0.push(ConfigEntry {
                    key: key.to_string(),
                    value: Some(value.to_string()),
                    description,
                });
            }

            fn none(&mut self, key: &str, description: &'static str) {
                self.0.push(ConfigEntry {
                    key: key.to_string(),
                    value: None,
                    description,
                });
            }
        }
        let mut entries = Entries(vec![]);
        ConfigField::visit(self, &mut entries, <Self as ConfigExtension>::PREFIX, "");
        entries.0
    }
}

impl ConfigExtension for FlumenConfig {
    const PREFIX: &'static str = "flumen";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_but_the_startup_options_goes_back_to_its_default() {
        let defaults = FlumenConfig::default().entries();
        let changed = FlumenConfig {
            target_block_rows: 7,
            delta_txn_version: Some(3),
            cluster: "h1:1".into(),
            ..Default::default()
        };
        for entry in &defaults {
            let name = entry
                .key
                .strip_prefix("flumen.")
                .expect("entries are named flumen.*");
            if name == "worker_binary" || name == "worker_module" {
                let err = changed.with_default(name).unwrap_err().to_string();
                assert!(err.contains("startup options"), "{err}");
                continue;
            }
            let reset = changed.with_default(name).unwrap();
            let value = |config: &FlumenConfig| {
                let entries = config.entries();
                entries
                    .into_iter()
                    .find(|e| e.key == entry.key)
                    .unwrap()
                    .value
            };
            assert_eq!(value(&reset), entry.value, "{name}");
        }
        // Only the one named goes back.
        let reset = changed.with_default("cluster").unwrap();
        assert_eq!((reset.target_block_rows, reset.cluster.as_str()), (7, ""));
        let err = changed.with_default("nosuch").unwrap_err().to_string();
        assert!(err.contains("nosuch"), "{err}");
    }

    #[test]
    fn a_session_lists_flumens_settings_by_the_names_set_takes() {
        let mut options = datafusion::config::ConfigOptions::new();
        options.extensions.insert(FlumenConfig::default());
        options.set("flumen.target_block_rows", "100").unwrap();
        let entries = options.entries();
        let named = |key: &str| {
            entries
                .iter()
                .find(|e| e.key == key)
                .map(|e| e.value.clone())
        };
        assert_eq!(named("flumen.target_block_rows"), Some(Some("100".into())));
        assert_eq!(named("flumen.delta_txn_version"), Some(None));
        assert_eq!(named("target_block_rows"), None);
    }

    #[test]
    fn byte_sizes_parse_with_units() {
        assert_eq!("2GB".parse::<ByteSize>().unwrap().0, 2 << 30);
        assert_eq!("512 MiB".parse::<ByteSize>().unwrap().0, 512 << 20);
        assert_eq!("1000".parse::<ByteSize>().unwrap().0, 1000);
        assert_eq!("1.5k".parse::<ByteSize>().unwrap().0, 1536);
        let err = "lots".parse::<ByteSize>().unwrap_err().to_string();
        assert!(err.contains("a byte count such as '2GB'"), "{err}");
    }

    #[test]
    fn a_refused_set_names_the_setting_what_it_takes_and_the_value() {
        let mut options = datafusion::config::ConfigOptions::new();
        options.extensions.insert(FlumenConfig::default());
        let refused =
            |key: &str, value: &str| options.clone().set(key, value).unwrap_err().to_string();
        let config = "Invalid or Unsupported Configuration: ";
        assert_eq!(
            refused("flumen.split_bytes", "lots"),
            format!(
                "{config}flumen.split_bytes must be a byte count such as '2GB', '512MiB' or \
                 '1000000', got 'lots'"
            )
        );
        assert_eq!(
            refused("flumen.max_task_retries", "-1"),
            format!("{config}flumen.max_task_retries must be a whole number (0 or more), got '-1'")
        );
        assert_eq!(
            refused("flumen.output_fsync", "maybe"),
            format!("{config}flumen.output_fsync must be true or false, got 'maybe'")
        );
        // A kind of flumen's own names the setting itself, once.
        assert_eq!(
            refused("flumen.exchange_compression", "bogus"),
            format!(
                "{config}flumen.exchange_compression must be 'none', 'lz4' or 'zstd', got 'bogus'"
            )
        );
    }

    #[test]
    fn shuffle_seeds_parse() {
        assert_eq!("42".parse::<ShuffleSeed>().unwrap(), ShuffleSeed(Some(42)));
        assert_eq!("".parse::<ShuffleSeed>().unwrap(), ShuffleSeed(None));
        assert_eq!("Random".parse::<ShuffleSeed>().unwrap(), ShuffleSeed(None));
        let err = "-1".parse::<ShuffleSeed>().unwrap_err().to_string();
        assert!(err.contains("flumen.shuffle_seed"), "{err}");
    }

    #[test]
    fn preprocess_settings_parse() {
        assert_eq!(
            "TRUE".parse::<PreprocessOnCpu>().unwrap(),
            PreprocessOnCpu::Always
        );
        assert_eq!(
            "false".parse::<PreprocessOnCpu>().unwrap(),
            PreprocessOnCpu::Never
        );
        assert_eq!(
            "auto".parse::<PreprocessOnCpu>().unwrap(),
            PreprocessOnCpu::Auto
        );
        let err = "maybe".parse::<PreprocessOnCpu>().unwrap_err().to_string();
        assert!(err.contains("flumen.preprocess_on_cpu"), "{err}");
    }

    #[test]
    fn feed_joins_settings_parse_and_print_back() {
        for (text, value) in [
            ("true", FeedJoins::ReadAsMade),
            ("ALL", FeedJoins::All),
            ("false", FeedJoins::Off),
        ] {
            assert_eq!(text.parse::<FeedJoins>().unwrap(), value);
            assert_eq!(value.to_string().parse::<FeedJoins>().unwrap(), value);
        }
        let err = "some".parse::<FeedJoins>().unwrap_err().to_string();
        assert!(err.contains("flumen.feed_joins_on_workers"), "{err}");
    }

    #[test]
    fn exchange_compression_settings_parse_and_print_back() {
        for (text, value) in [
            ("none", ExchangeCompression::None),
            ("LZ4", ExchangeCompression::Lz4),
            ("zstd", ExchangeCompression::Zstd),
        ] {
            assert_eq!(text.parse::<ExchangeCompression>().unwrap(), value);
            assert_eq!(
                value.to_string().parse::<ExchangeCompression>().unwrap(),
                value
            );
        }
        assert_eq!(ExchangeCompression::None.ipc(), None);
        let err = "gzip"
            .parse::<ExchangeCompression>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("flumen.exchange_compression"), "{err}");
    }

    #[test]
    fn modes_parse() {
        assert_eq!("Batch".parse::<ExecMode>().unwrap(), ExecMode::Batch);
        assert_eq!("static".parse::<ExecMode>().unwrap(), ExecMode::Static);
        assert!("fast".parse::<ExecMode>().is_err());
    }
}
