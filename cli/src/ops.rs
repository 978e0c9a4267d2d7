//! `rvisor health`, `rvisor packages` (the list) and `rvisor validate`:
//! one-off commands on a quiet supervisor.

use crate::run::read_code;
use crate::{supervisor_quiet, supervisor_quiet_with};
use anyhow::Result;
use std::process::ExitCode;

pub(crate) fn ops_health(json: bool) -> Result<ExitCode> {
    let sup = supervisor_quiet()?;
    let mut h = sup.health();
    h.style_engine = rvisor_server::service::style_engine(sup.config().style);
    if json {
        println!("{}", serde_json::to_string_pretty(&h)?);
    } else {
        println!(
            "status: {}\nrvisor {} with R {}",
            h.status, h.version, h.r_version
        );
        println!(
            "workers: {:?} mode; sandbox: {}{}",
            h.workers.mode,
            h.sandbox.mode,
            h.sandbox
                .privilege
                .as_deref()
                .map(|p| format!(" ({p})"))
                .unwrap_or_default()
        );
        for layer in &h.sandbox.layers {
            println!("  {layer}");
        }
        if let Some(programs) = &h.sandbox.programs {
            if programs.is_empty() {
                println!("programs: none (--allow-program NAME allows one)");
            } else {
                println!("programs workers may run:");
                for p in programs {
                    println!("  {:<24} {:<32} {}", p.name, p.file, p.reason);
                }
            }
        }
        let r = &h.rules;
        println!(
            "rules: scripts up to {} bytes, nesting up to {}, timeout {} s ({}..{}), up to {} data frames and {} variables",
            r.max_script_bytes, r.max_nesting_depth, r.timeout_seconds.default, r.timeout_seconds.min,
            r.timeout_seconds.max, r.max_dataframes, r.max_variables
        );
        println!("forbidden functions: {}", r.forbidden_functions.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn ops_packages(json: bool) -> Result<ExitCode> {
    let list = supervisor_quiet()?
        .packages()
        .map_err(|e| anyhow::anyhow!(e))?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "packages": list }))?
        );
    } else {
        for p in &list {
            println!("{:<24} {:<12} {}", p.name, p.version, p.library);
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn ops_validate(file: &str, json: bool, style: &str) -> Result<ExitCode> {
    let script = read_code(file)?;
    let style = rvisor::StyleEngine::parse(style).unwrap_or_default();
    // The service's validation, as HTTP, nng and MCP get it.
    let v = rvisor_server::service::validate(&supervisor_quiet_with(style)?, &script);
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        let at = |l: Option<u32>, c: Option<u32>| match (l, c) {
            (Some(l), Some(c)) => format!("{file}:{l}:{c}: "),
            (Some(l), None) => format!("{file}:{l}: "),
            _ => format!("{file}: "),
        };
        for p in &v.problems {
            println!("{}error [{}] {}", at(p.line, p.column), p.kind, p.message);
        }
        for p in &v.warnings {
            println!("{}warning [{}] {}", at(p.line, p.column), p.kind, p.message);
        }
        for s in &v.style {
            println!("{}style [{}] {}", at(s.line, s.column), s.rule, s.message);
        }
        println!("{}", if v.valid { "valid" } else { "invalid" });
    }
    Ok(if v.valid {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
