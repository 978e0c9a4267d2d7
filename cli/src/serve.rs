//! `rvisor serve` (the HTTP service, and nng with `--nng`) and `rvisor
//! mcp` (MCP over stdio): their flags and the supervisor and server
//! configurations they build.

use crate::{base_config, packages, STYLE_ENGINES};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Options of `rvisor serve`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8787")]
    listen: std::net::SocketAddr,
    /// Token file: one `TOKEN TENANT` pair per line.
    #[arg(long, conflicts_with = "no_auth")]
    tokens: Option<PathBuf>,
    /// Serve without authentication (one local user).
    #[arg(long)]
    no_auth: bool,
    /// A tenant (of the token file) whose tokens may read the server-wide
    /// /metrics (repeatable); other tenants see only their own /v1/usage.
    #[arg(long = "operator", value_name = "TENANT", requires = "tokens")]
    operators: Vec<String>,
    /// Sessions one tenant may hold open; one more is refused (429) until
    /// one closes.
    #[arg(long, default_value_t = 32, value_name = "N")]
    max_sessions_per_tenant: usize,
    /// Sessions of all tenants together.
    #[arg(long, default_value_t = 512, value_name = "N")]
    max_sessions: usize,
    /// Sessions holding a worker at once, host-wide (0: no cap). A call to
    /// a session without one first hibernates the least recently used
    /// idle session (with --state-dir), else is refused (503, Retry-After).
    #[arg(long, default_value_t = rvisor_server::admission::DEFAULT_MAX_LIVE_SESSIONS, value_name = "N")]
    max_live_sessions: usize,
    /// Sessions of one tenant holding a worker at once (0: no cap); over
    /// it that tenant's idle sessions hibernate first, else 429.
    #[arg(long, default_value_t = rvisor_server::admission::DEFAULT_MAX_LIVE_SESSIONS_PER_TENANT, value_name = "N")]
    max_live_sessions_per_tenant: usize,
    /// Calls running or queued at once for one tenant, across its sessions
    /// (0: no cap); one more is refused (429, Retry-After).
    #[arg(long, default_value_t = rvisor_server::admission::DEFAULT_MAX_CALLS_PER_TENANT, value_name = "N")]
    max_calls_per_tenant: usize,
    /// Memory the live workers may use together, MiB (PSS, else RSS; 0: no
    /// budget). Default: 3/4 of the cgroup's memory.max or of MemTotal,
    /// whichever is smaller. Over it idle sessions hibernate, least
    /// recently used first (the tenants over their fair share first), and
    /// if the calls themselves hold the memory, the largest running call
    /// of the tenant most over its fair share is stopped.
    #[arg(long, value_name = "MIB")]
    memory_budget_mb: Option<u64>,
    /// Memory one tenant's live workers may use together, MiB (default:
    /// none beyond the budget and its fair shares). Over it the tenant's
    /// idle sessions hibernate, then its largest running call is stopped;
    /// a call that would need one more worker is refused (429 `quota`).
    #[arg(long, value_name = "MIB")]
    tenant_memory_budget_mb: Option<u64>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Where tables (data pointers) are stored; they survive restarts.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// How long a data pointer lives, in hours.
    #[arg(long, default_value_t = 24.0)]
    table_ttl_hours: f64,
    /// Where sessions are kept durable on this host (docs/sessions.md):
    /// with it, sessions are checkpointed when idle, hibernate (worker
    /// released) after --hibernate-after-secs, a killed call restores the
    /// last checkpoint, and a restart of the server (SIGTERM, SIGINT)
    /// keeps every session: the same ids go on. Several nodes keep
    /// sessions in the shared --store instead.
    #[arg(long, value_name = "DIR", conflicts_with = "store")]
    state_dir: Option<PathBuf>,
    /// With --state-dir or --store: days a session may go unused (no call,
    /// not running on any node) before it is deleted (0: kept until
    /// closed).
    #[arg(long, default_value_t = 7.0, value_name = "DAYS", value_parser = non_negative_secs)]
    session_ttl_days: f64,
    /// With --store and a node id: seconds a node's lease on a session
    /// lasts without renewal (renewed every third of it); after a node is
    /// lost, another takes its sessions over once their leases expire
    /// (at least 3).
    #[arg(long, default_value_t = 10.0, value_name = "SECS", value_parser = positive_secs)]
    lease_secs: f64,
    /// With --state-dir or --store: the most one session's checkpoint may
    /// take, MiB (compressed). A state over it is not checkpointed: the
    /// session says so in its status (`checkpoint.failure`), keeps its
    /// worker, and is not picked for hibernation again until it changed.
    #[arg(long, default_value_t = 1024, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    checkpoint_max_mb: u64,
    /// With --state-dir or --store: the most one tenant's checkpoints may
    /// take together in the store, MiB (0: no quota). A checkpoint that
    /// would pass it is refused (429 `quota` when asked for).
    #[arg(long, default_value_t = 4096, value_name = "MIB")]
    checkpoint_quota_mb: u64,
    /// The most one tenant's files may take together, MiB (0: no quota):
    /// its sessions' files and its run artifacts not yet expired, counted
    /// from the store by every node. An upload that would pass it is
    /// refused (429 `quota`); a run's artifacts are not kept.
    #[arg(long, default_value_t = rvisor::file_rules::FileLimits::default().max_tenant_bytes >> 20, value_name = "MIB")]
    file_quota_mb: u64,
    /// With --state-dir: seconds a session may be idle before it hibernates
    /// (0: never).
    #[arg(long, default_value_t = 600.0, value_name = "SECS", value_parser = non_negative_secs)]
    hibernate_after_secs: f64,
    /// Style notes of /v1/validate: `auto` or `rvisor` (lintr's default
    /// linters in Rust, rvisor-lint: ~1 ms for 100 lines), `lintr` (lintr
    /// itself when installed: the thorough engine and the reference, ~1-2 s
    /// for 100 lines), `builtin` (the R driver's few rules) or `none`.
    #[arg(long, default_value = "auto", value_parser = STYLE_ENGINES)]
    style: String,
    /// Also serve on an nng REQ/REP socket (ipc:///path or
    /// tcp://127.0.0.1:PORT) for hosts that are not Rust: JSON requests
    /// with a "token" field (docs/nng.md).
    #[arg(long, value_name = "URL")]
    nng: Option<rvisor_server::nng::NngUrl>,
    /// HTTP: seconds a client has to send a request's headers (from
    /// connecting, or from the first byte of a later request); slower
    /// connections are dropped.
    #[arg(long, default_value_t = 10.0, value_name = "SECS", value_parser = positive_secs)]
    header_timeout_secs: f64,
    /// HTTP: seconds a request body may take to arrive (JSON bodies in
    /// all, uploads between two pieces).
    #[arg(long, default_value_t = 30.0, value_name = "SECS", value_parser = positive_secs)]
    body_timeout_secs: f64,
    /// HTTP: seconds a kept-alive connection may wait for its next request.
    #[arg(long, default_value_t = 60.0, value_name = "SECS", value_parser = positive_secs)]
    idle_timeout_secs: f64,
    /// nng: seconds a connection may stay silent with no request in flight.
    #[arg(long, default_value_t = 300.0, value_name = "SECS", value_parser = positive_secs)]
    nng_idle_timeout_secs: f64,
    /// Open connections per listener (HTTP, nng); more are closed at once
    /// (HTTP: with a 503).
    #[arg(long, default_value_t = 1024, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Open connections per client IP address per listener.
    #[arg(long, default_value_t = 64, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_connections_per_ip: u32,
    /// At SIGINT/SIGTERM: seconds requests in flight get to finish before
    /// every connection is closed.
    #[arg(long, default_value_t = 30.0, value_name = "SECS", value_parser = non_negative_secs)]
    shutdown_grace_secs: f64,
    /// This node's id when several serve behind one router
    /// (docs/scale-out.md): session ids become `ID.s-...`. `hostname`
    /// takes `nN` from a StatefulSet pod's name (`rvisor-2` gives n2).
    /// Default: $RVISOR_NODE_ID, else none (ids `s-...`).
    #[arg(long, value_name = "ID")]
    node_id: Option<String>,
    /// The store shared by several nodes, of tables and durable sessions:
    /// `s3://BUCKET/PREFIX` (endpoint and credentials from AWS_ENDPOINT,
    /// AWS_ALLOW_HTTP, AWS_REGION, AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY) or a directory. Default: $RVISOR_STORE, else
    /// tables in DATA_DIR/store and sessions durable only with --state-dir.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// At SIGTERM: seconds calls in flight get to finish while the node
    /// drains (readiness false, new sessions and runs refused with 503,
    /// existing sessions still answered) before it stops. Default: the
    /// shutdown grace (one knob unless the two are set apart).
    #[arg(long, value_name = "SECS", value_parser = non_negative_secs)]
    drain_grace_secs: Option<f64>,
    /// Streamed calls (SSE, JSON lines): KiB of one stream's events that
    /// may wait for a client reading more slowly than its call writes (at
    /// least 256). Past it the client gets one `lagged` event in place of
    /// the events it missed; the call never waits, and its result, which
    /// holds all of its output, still comes last.
    #[arg(long, default_value_t = (rvisor::DEFAULT_STREAM_BUFFER_BYTES >> 10) as u64, value_name = "KIB", value_parser = buffer_kib)]
    stream_buffer_kb: u64,
    /// The same for all open streams of one tenant together (0: no
    /// tenant bound, each stream keeps its own).
    #[arg(long, default_value_t = (rvisor_server::service::DEFAULT_TENANT_STREAM_BUFFER_BYTES >> 10) as u64, value_name = "KIB", value_parser = tenant_buffer_kib)]
    tenant_stream_buffer_kb: u64,
    /// Entries of each session's history (the console's, and `GET
    /// /v1/sessions/{id}/history`; docs/console.md); past it the oldest
    /// leave (1 to 10,000).
    #[arg(long, default_value_t = rvisor_server::service::DEFAULT_HISTORY_ENTRIES as u64, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=10_000))]
    history_entries: u64,
    /// KiB of each session's history (64 to 1,048,576); past it the
    /// oldest entries leave. One entry holds at most a quarter of it.
    #[arg(long, default_value_t = (rvisor_server::service::DEFAULT_HISTORY_BYTES >> 10) as u64, value_name = "KIB", value_parser = clap::value_parser!(u64).range(64..=1_048_576))]
    history_kb: u64,
    #[command(flatten)]
    packages: packages::PackageArgs,
}

/// A stream buffer in KiB: at least [`rvisor::MIN_STREAM_BUFFER_BYTES`]
/// (room for the largest single events), at most 1 GiB.
fn buffer_kib(s: &str) -> Result<u64, String> {
    let min = (rvisor::MIN_STREAM_BUFFER_BYTES >> 10) as u64;
    match s.parse::<u64>() {
        Ok(v) if (min..=1 << 20).contains(&v) => Ok(v),
        _ => Err(format!(
            "{s:?}: give a size in KiB from {min} (room for the largest single events) to 1048576"
        )),
    }
}

/// [`buffer_kib`], or 0 for none.
fn tenant_buffer_kib(s: &str) -> Result<u64, String> {
    match s {
        "0" => Ok(0),
        _ => buffer_kib(s).map_err(|e| format!("{e}, or 0 for no tenant bound")),
    }
}

/// The node id of `serve`: the flag, else $RVISOR_NODE_ID; `hostname`
/// means the pod ordinal of the host name.
fn node_id(flag: Option<String>) -> Result<Option<String>> {
    let Some(v) = flag.or_else(|| {
        std::env::var("RVISOR_NODE_ID")
            .ok()
            .filter(|v| !v.is_empty())
    }) else {
        return Ok(None);
    };
    let id = if v == "hostname" {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("failed to read the host name for --node-id hostname")?;
        rvisor_server::cluster::NodeId::from_hostname(host.trim())
    } else {
        rvisor_server::cluster::NodeId::parse(&v)
    };
    Ok(Some(
        id.map_err(|e| anyhow::anyhow!("--node-id: {e}"))?
            .to_string(),
    ))
}

/// A number of seconds above zero (and below a century).
fn positive_secs(s: &str) -> Result<f64, String> {
    match non_negative_secs(s)? {
        0.0 => Err("must be above 0 seconds".into()),
        v => Ok(v),
    }
}

/// A cap flag: 0 means no cap.
fn uncapped(n: usize) -> usize {
    if n == 0 {
        usize::MAX
    } else {
        n
    }
}

/// A number of seconds, 0 or more (and below a century).
pub(crate) fn non_negative_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..3.2e9).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds (e.g. 10 or 0.5)")),
    }
}

pub(crate) fn serve(a: ServeArgs) -> Result<ExitCode> {
    let tokens = match (a.tokens, a.no_auth) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("failed to read the token file {}", path.display()))?;
            Some(rvisor_server::http::read_tokens(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?)
        }
        (None, true) => None,
        (None, false) => bail!(
            "choose how clients authenticate: --tokens FILE (lines of `TOKEN TENANT`) or --no-auth for a single local user"
        ),
    };
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("rvisor=info")),
        )
        .init();
    let node_id = node_id(a.node_id)?;
    let store = match a
        .store
        .or_else(|| std::env::var("RVISOR_STORE").ok().filter(|v| !v.is_empty()))
    {
        Some(s) => Some(
            s.parse::<rvisor_server::blob::StoreUrl>()
                .map_err(|e| anyhow::anyhow!("--store: {e}"))?,
        ),
        None => None,
    };
    let durable = match (&a.state_dir, &store) {
        (Some(dir), _) => Some(
            rvisor_server::durable::SessionStore::open(
                &rvisor_server::blob::StoreUrl::Local(dir.clone()),
                None,
                rvisor_server::durable::DEFAULT_LEASE_TTL,
            )
            .map_err(|e| anyhow::anyhow!("--state-dir {}: {e}", dir.display()))?,
        ),
        (None, Some(url)) => Some({
            let min = rvisor_server::durable::MIN_LEASE_TTL;
            if a.lease_secs < min.as_secs_f64() {
                anyhow::bail!(
                    "--lease-secs {} is too short: a lease needs at least {} s (a node writes \
                     checkpoints only while a second of it is left); use --lease-secs {} or more",
                    a.lease_secs,
                    min.as_secs(),
                    min.as_secs()
                );
            }
            rvisor_server::durable::SessionStore::open(
                url,
                node_id.clone(),
                Duration::from_secs_f64(a.lease_secs),
            )
            .map_err(|e| anyhow::anyhow!("--store {url}: {e}"))?
        }),
        (None, None) => None,
    };
    let installer = a.packages.installer(
        a.state_dir.as_deref(),
        a.data_dir.as_deref(),
        &base_config().worker.libpath,
    )?;
    let mut tables = rvisor_server::tables::TableConfig::default();
    if let Some(dir) = a.data_dir {
        tables.dir = dir;
    }
    let checkpoint_limits = rvisor_server::durable::CheckpointLimits {
        max_bytes: a.checkpoint_max_mb.saturating_mul(1 << 20),
        tenant_quota_bytes: match a.checkpoint_quota_mb {
            0 => u64::MAX,
            m => m.saturating_mul(1 << 20),
        },
        // Staged next to the state directory's files, else in the data
        // directory: a local disk, not memory.
        spool_dir: match &a.state_dir {
            Some(d) => d.clone(),
            None => tables.dir.join("checkpoint-spool"),
        },
    };
    let checkpoints = durable.as_ref().map(|d| d.checkpoints(checkpoint_limits));
    let defaults = rvisor::SessionOptions {
        hibernate_after: (a.hibernate_after_secs > 0.0)
            .then(|| Duration::from_secs_f64(a.hibernate_after_secs)),
        ..Default::default()
    };
    let sup = rvisor::Supervisor::new(rvisor::SupervisorConfig {
        style: rvisor::StyleEngine::parse(&a.style).unwrap_or_default(),
        node_id,
        checkpoints,
        defaults,
        ..base_config()
    })?;
    tables.store = store;
    tables.ttl = Duration::from_secs_f64(a.table_ttl_hours.max(0.0) * 3600.0);
    if let Some(t) = &tokens {
        for o in &a.operators {
            if !t.values().any(|tenant| tenant == o) {
                bail!("--operator {o}: no token in the token file belongs to tenant {o:?}");
            }
        }
    }
    let cfg = rvisor_server::http::ServeConfig {
        listen: a.listen,
        operators: a.operators.clone(),
        max_sessions_per_tenant: a.max_sessions_per_tenant,
        max_sessions: a.max_sessions,
        admission: rvisor_server::admission::AdmissionConfig {
            max_live_sessions: uncapped(a.max_live_sessions),
            max_live_sessions_per_tenant: uncapped(a.max_live_sessions_per_tenant),
            max_calls_per_tenant: uncapped(a.max_calls_per_tenant),
            memory_budget_bytes: match a.memory_budget_mb {
                None => rvisor_server::admission::default_memory_budget().0,
                Some(0) => u64::MAX,
                Some(m) => m.saturating_mul(1 << 20),
            },
            tenant_memory_bytes: match a.tenant_memory_budget_mb {
                None | Some(0) => u64::MAX,
                Some(m) => m.saturating_mul(1 << 20),
            },
        },
        tokens,
        max_body_bytes: a.max_body_bytes,
        tables,
        nng: a.nng,
        connections: rvisor_server::listen::ConnectionLimits {
            header_timeout: Duration::from_secs_f64(a.header_timeout_secs),
            body_timeout: Duration::from_secs_f64(a.body_timeout_secs),
            idle_timeout: Duration::from_secs_f64(a.idle_timeout_secs),
            nng_idle_timeout: Duration::from_secs_f64(a.nng_idle_timeout_secs),
            max_connections: a.max_connections as usize,
            max_connections_per_ip: a.max_connections_per_ip as usize,
            shutdown_grace: Duration::from_secs_f64(a.shutdown_grace_secs),
        },
        drain_grace: a.drain_grace_secs.map(Duration::from_secs_f64),
        files: rvisor::file_rules::FileLimits {
            max_tenant_bytes: match a.file_quota_mb {
                0 => u64::MAX,
                m => m.saturating_mul(1 << 20),
            },
            ..Default::default()
        },
        durable,
        session_ttl: (a.session_ttl_days > 0.0)
            .then(|| Duration::from_secs_f64(a.session_ttl_days * 86400.0)),
        streams: rvisor_server::service::StreamConfig {
            per_stream_bytes: (a.stream_buffer_kb as usize) << 10,
            per_tenant_bytes: match a.tenant_stream_buffer_kb {
                0 => usize::MAX,
                k => (k as usize) << 10,
            },
        },
        packages: installer,
        history: rvisor_server::service::HistoryLimits {
            max_entries: a.history_entries as usize,
            max_bytes: (a.history_kb as usize) << 10,
            max_entry_bytes: ((a.history_kb as usize) << 10) / 4,
        },
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("failed to start the async runtime")?;
    let served = rt.block_on(rvisor_server::http::serve(sup, cfg));
    // The server has closed its connections and shut the supervisor down; a
    // blocking handler still finishing must not keep the process alive.
    rt.shutdown_timeout(Duration::from_secs(5));
    served.context("the server failed")?;
    Ok(ExitCode::SUCCESS)
}

/// The checkpoint store of `--state-dir DIR`.
pub(crate) fn state_store(
    dir: &std::path::Path,
) -> Result<std::sync::Arc<dyn rvisor::checkpoint::CheckpointStore>> {
    let store = rvisor::checkpoint::DirStore::new(dir)
        .with_context(|| format!("--state-dir {}: cannot create or open it", dir.display()))?;
    Ok(std::sync::Arc::new(store))
}

pub(crate) fn mcp(
    data_dir: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    hibernate_after_secs: f64,
    packages: &packages::PackageArgs,
) -> Result<ExitCode> {
    let installer = packages.installer(
        state_dir.as_deref(),
        data_dir.as_deref(),
        &base_config().worker.libpath,
    )?;
    let checkpoints = state_dir.as_deref().map(state_store).transpose()?;
    let defaults = rvisor::SessionOptions {
        hibernate_after: (hibernate_after_secs > 0.0)
            .then(|| Duration::from_secs_f64(hibernate_after_secs)),
        ..Default::default()
    };
    let sup = rvisor::Supervisor::new(rvisor::SupervisorConfig {
        checkpoints,
        defaults,
        ..base_config()
    })?;
    sup.cleanup_on_signals()?;
    // Without --data-dir the connection's tables live in a directory of its
    // own, removed at the end: two MCP servers (two agent windows) must not
    // share one table index.
    let mut tables = rvisor_server::tables::TableConfig::default();
    let private = data_dir.is_none().then(|| {
        std::env::temp_dir().join(format!("rvisor-mcp-tables-{}", rvisor::ids::random_hex(6)))
    });
    match (data_dir, &private) {
        (Some(dir), _) => tables.dir = dir,
        (None, Some(dir)) => tables.dir = dir.clone(),
        (None, None) => {}
    }
    // Read on a thread of the server's own, so the end of the input is
    // seen (and cancels the call in flight) while a call runs.
    let stdin = std::io::BufReader::new(std::io::stdin());
    let cfg = rvisor_server::service::ServiceConfig {
        tables,
        packages: installer,
        ..Default::default()
    };
    let served = rvisor_server::mcp::serve_with(&sup, cfg, stdin, crate::out::stdout());
    if let Some(dir) = private {
        let _ = std::fs::remove_dir_all(dir);
    }
    served?;
    sup.shutdown();
    Ok(ExitCode::SUCCESS)
}
