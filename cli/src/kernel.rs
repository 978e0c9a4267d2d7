//! `rvisor kernel`: the Jupyter kernel (`--connection-file FILE`, as a
//! front end starts it) and `rvisor kernel install` (its kernelspec).

use super::SessionArgs;
use anyhow::{bail, Context, Result};
use rvisor_kernel::kernelspec::{self, Target};
use rvisor_server::service::{Service, ServiceConfig};
use rvisor_server::tables::TableConfig;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `rvisor kernel`.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct KernelArgs {
    #[command(subcommand)]
    action: Option<KernelAction>,
    /// The connection file the Jupyter front end wrote.
    #[arg(long, value_name = "FILE")]
    connection_file: Option<PathBuf>,
    #[command(flatten)]
    opts: SessionArgs,
}

#[derive(clap::Subcommand, Debug)]
enum KernelAction {
    /// Write a kernelspec so `jupyter kernelspec list` (and every Jupyter
    /// front end) finds this kernel; arguments after `--` are added to
    /// the kernel's command (session flags: `-- --timeout 120`).
    Install {
        /// Into the user's Jupyter directory (~/.local/share/jupyter).
        #[arg(long, conflicts_with = "prefix")]
        user: bool,
        /// Into PREFIX/share/jupyter (a virtualenv's prefix, say).
        #[arg(long, value_name = "DIR")]
        prefix: Option<PathBuf>,
        /// The kernel's name (its directory).
        #[arg(long, default_value = "rvisor")]
        name: String,
        /// The name front ends show.
        #[arg(long, default_value = "R (rvisor)")]
        display_name: String,
        /// Flags of `rvisor kernel` the spec passes (after `--`).
        #[arg(last = true)]
        extra: Vec<String>,
    },
}

/// Runs `rvisor kernel`.
pub(crate) fn main(args: KernelArgs) -> Result<ExitCode> {
    match args.action {
        Some(KernelAction::Install {
            user,
            prefix,
            name,
            display_name,
            extra,
        }) => install(user, prefix, &name, &display_name, &extra),
        None => {
            let Some(file) = args.connection_file else {
                bail!(
                    "pass --connection-file FILE (Jupyter does, from the kernelspec that \
                     `rvisor kernel install --user` writes)"
                );
            };
            serve(&file, &args.opts)
        }
    }
}

fn install(
    user: bool,
    prefix: Option<PathBuf>,
    name: &str,
    display_name: &str,
    extra: &[String],
) -> Result<ExitCode> {
    let target = match (user, prefix) {
        (true, _) => Target::User,
        (false, Some(p)) => Target::Prefix(p),
        (false, None) => Target::System,
    };
    let program = std::env::current_exe()
        .context("failed to find this program's own path for the kernelspec")?;
    let dir = kernelspec::install(&target, name, display_name, &program, extra)?;
    println!(
        "rvisor: installed the kernelspec {name:?} in {}",
        dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn serve(file: &std::path::Path, opts: &SessionArgs) -> Result<ExitCode> {
    let conn = rvisor_kernel::ConnectionInfo::read(file)?;
    let mut cfg = opts.supervisor_config();
    cfg.defaults = opts.options()?;
    let input = rvisor_kernel::configure(&mut cfg.defaults);
    cfg.checkpoints = opts.checkpoints()?;
    // The per-call timeout range stretched to the session's timeout, as for
    // `session --jsonl` (a notebook may run long fits).
    let t = &mut cfg.rules.timeout_seconds;
    t.default = cfg.defaults.timeout.as_secs().max(1);
    t.max = t.max.max(cfg.defaults.timeout.as_secs_f64().ceil() as u64);
    let sup = rvisor::Supervisor::new(cfg)?;
    let dir = std::env::temp_dir().join(format!(
        "rvisor-kernel-tables-{}",
        rvisor::ids::random_hex(6)
    ));
    let service = Service::new(
        sup.clone(),
        ServiceConfig {
            tables: TableConfig {
                dir: dir.clone(),
                ..TableConfig::default()
            },
            ..ServiceConfig::default()
        },
    )
    .context("failed to start the service")?;
    let served = rvisor_kernel::run(service.clone(), &conn, input);
    service.close_all();
    sup.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    served?;
    Ok(ExitCode::SUCCESS)
}
