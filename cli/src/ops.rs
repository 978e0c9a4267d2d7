//! `rvisor health`, `rvisor packages` (the list) and `rvisor validate`:
//! one-off commands on a quiet supervisor.

use crate::out::emit;
use crate::run::read_code;
use crate::{supervisor_quiet, supervisor_quiet_with};
use anyhow::Result;
use std::fmt::Write as _;
use std::process::ExitCode;

pub(crate) fn ops_health(json: bool) -> Result<ExitCode> {
    let mut o = String::new();
    let sup = supervisor_quiet()?;
    let mut h = sup.health();
    h.style_engine = rvisor_server::service::style_engine(sup.config().style);
    if json {
        writeln!(o, "{}", serde_json::to_string_pretty(&h)?)?;
    } else {
        writeln!(
            o,
            "status: {}\nrvisor {} with R {}",
            h.status, h.version, h.r_version
        )?;
        writeln!(
            o,
            "workers: {:?} mode; sandbox: {}{}",
            h.workers.mode,
            h.sandbox.mode,
            h.sandbox
                .privilege
                .as_deref()
                .map(|p| format!(" ({p})"))
                .unwrap_or_default()
        )?;
        for layer in &h.sandbox.layers {
            writeln!(o, "  {layer}")?;
        }
        if let Some(programs) = &h.sandbox.programs {
            if programs.is_empty() {
                writeln!(o, "programs: none (--allow-program NAME allows one)")?;
            } else {
                writeln!(o, "programs workers may run:")?;
                for p in programs {
                    writeln!(o, "  {:<24} {:<32} {}", p.name, p.file, p.reason)?;
                }
            }
        }
        let r = &h.rules;
        writeln!(
            o,
            "rules: scripts up to {} bytes, nesting up to {}, timeout {} s ({}..{}), up to {} data frames and {} variables",
            r.max_script_bytes, r.max_nesting_depth, r.timeout_seconds.default, r.timeout_seconds.min,
            r.timeout_seconds.max, r.max_dataframes, r.max_variables
        )?;
        writeln!(
            o,
            "forbidden functions: {}",
            r.forbidden_functions.join(", ")
        )?;
    }
    emit(&o)?;
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn ops_packages(json: bool) -> Result<ExitCode> {
    let mut o = String::new();
    let list = supervisor_quiet()?
        .packages()
        .map_err(|e| anyhow::anyhow!(e))?;
    if json {
        writeln!(
            o,
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "packages": list }))?
        )?;
    } else {
        for p in &list {
            writeln!(o, "{:<24} {:<12} {}", p.name, p.version, p.library)?;
        }
    }
    emit(&o)?;
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn ops_validate(file: &str, json: bool, style: &str) -> Result<ExitCode> {
    let script = read_code(file)?;
    let mut o = String::new();
    let style = rvisor::StyleEngine::parse(style).unwrap_or_default();
    // The service's validation, as HTTP, nng and MCP get it.
    let v = rvisor_server::service::validate(&supervisor_quiet_with(style)?, &script);
    if json {
        writeln!(o, "{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        let at = |l: Option<u32>, c: Option<u32>| match (l, c) {
            (Some(l), Some(c)) => format!("{file}:{l}:{c}: "),
            (Some(l), None) => format!("{file}:{l}: "),
            _ => format!("{file}: "),
        };
        let rows = (v
            .problems
            .iter()
            .map(|p| ("error", p.line, p.column, &p.kind, &p.message)))
        .chain(
            v.warnings
                .iter()
                .map(|p| ("warning", p.line, p.column, &p.kind, &p.message)),
        )
        .chain(
            v.style
                .iter()
                .map(|s| ("style", s.line, s.column, &s.rule, &s.message)),
        );
        for (what, line, column, kind, message) in rows {
            writeln!(o, "{}{what} [{kind}] {message}", at(line, column))?;
        }
        writeln!(o, "{}", if v.valid { "valid" } else { "invalid" })?;
    }
    emit(&o)?;
    Ok(if v.valid {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
