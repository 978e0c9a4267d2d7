//! The agent-facing operations besides running code: health (with the live
//! safety rules), installed packages, and validation that runs nothing.
//! Every surface (CLI, HTTP, MCP) answers from these.

pub use crate::rules::{
    check_variables, name_problem, syntactic_name, SafetyRules, StyleEngine, TimeoutRules,
    MAX_NAME_BYTES,
};
use crate::{CallOptions, Outcome, Supervisor};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// One finding that makes a script invalid (or, in `warnings`, that could
/// not be checked).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Problem {
    /// `empty`, `size`, `syntax`, `forbidden`, `nesting`.
    pub kind: String,
    /// What is wrong and what to do.
    pub message: String,
    /// Where (1-based), when known.
    pub line: Option<u32>,
    /// Where (1-based), when known.
    pub column: Option<u32>,
}

/// A style note; never blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StyleNote {
    /// The rule: lintr's linter name (e.g. `assignment_linter`) for the
    /// rvisor-lint and lintr engines.
    pub rule: String,
    /// What to change.
    pub message: String,
    /// Where (1-based).
    pub line: Option<u32>,
    /// Where (1-based).
    pub column: Option<u32>,
}

/// The answer of validation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Validation {
    /// True when there are no problems.
    pub valid: bool,
    /// What makes the script invalid.
    pub problems: Vec<Problem>,
    /// What could not be checked (e.g. `get()` of a computed name).
    pub warnings: Vec<Problem>,
    /// Style notes.
    pub style: Vec<StyleNote>,
    /// Which style checker ran: `rvisor-lint <version>` (the default: lintr's
    /// default linters in Rust, added by the service layer), `lintr
    /// <version>` (lintr itself, `--style lintr`), `builtin`, or `none`.
    pub style_engine: String,
}

/// An installed package.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Package {
    /// Name.
    pub name: String,
    /// Version.
    pub version: String,
    /// Library directory it loads from.
    pub library: String,
}

/// Liveness and the live rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    /// `ok`.
    pub status: String,
    /// rvisor's version.
    pub version: String,
    /// R's version.
    pub r_version: String,
    /// Since the supervisor started.
    pub uptime_seconds: f64,
    /// The style checker validation uses, as configured (`auto`, `rvisor`,
    /// `lintr`, `builtin`, `none`); the service reports the engine and its
    /// version instead (`rvisor-lint 0.1.0`).
    pub style_engine: String,
    /// The safety rules in force.
    pub rules: SafetyRules,
    /// Where workers come from.
    pub workers: crate::PoolStatus,
    /// Confinement in force.
    pub sandbox: Sandbox,
}

pub use crate::confine::Sandbox;

fn problem(kind: &str, message: String) -> Problem {
    Problem {
        kind: kind.into(),
        message,
        line: None,
        column: None,
    }
}

impl Supervisor {
    /// Checks a script without running it: empty, size, R's parser,
    /// forbidden functions (with positions), nesting depth; plus style notes
    /// (see [`crate::SupervisorConfig::style`]; the default fast engine's
    /// notes come from the service layer, `rvisor-server`, which calls this
    /// with [`StyleEngine::None`] and adds them).
    pub fn validate(&self, script: &str) -> Validation {
        self.validate_with(script, self.config().style)
    }

    /// [`Supervisor::validate`] with the given style checks (`None` for the
    /// problems only: what a run checks before it starts).
    pub fn validate_with(&self, script: &str, style: StyleEngine) -> Validation {
        let rules = &self.config().rules;
        let mut v = Validation {
            valid: true,
            problems: Vec::new(),
            warnings: Vec::new(),
            style: Vec::new(),
            style_engine: "none".into(),
        };
        if script.trim().is_empty() {
            v.problems.push(problem(
                "empty",
                "the script is empty; send at least one R expression".into(),
            ));
        } else if script.len() > rules.max_script_bytes {
            v.problems.push(problem(
                "size",
                format!(
                    "the script is {} bytes, over the limit of {} bytes; split it or load data by pointer",
                    script.len(),
                    rules.max_script_bytes
                ),
            ));
        } else {
            match self.with_validator(|w| {
                w.validate(
                    script,
                    &rules.forbidden_functions,
                    rules.max_nesting_depth,
                    style.worker_mode(),
                    Duration::from_secs(30),
                )
            }) {
                Ok(found) => {
                    let list = |key: &str| {
                        found
                            .get(key)
                            .cloned()
                            .unwrap_or(serde_json::Value::Array(vec![]))
                    };
                    v.problems = serde_json::from_value(list("problems")).unwrap_or_default();
                    v.warnings = serde_json::from_value(list("warnings")).unwrap_or_default();
                    v.style = serde_json::from_value(list("style")).unwrap_or_default();
                    if let Some(engine) = found.get("style_engine").and_then(|e| e.as_str()) {
                        v.style_engine = engine.to_string();
                    }
                    // The driver drops lintr's `_linter` suffix; notes name
                    // rules as lintr does whichever engine gave them.
                    if v.style_engine.starts_with("lintr") {
                        for n in &mut v.style {
                            if !n.rule.ends_with("_linter") {
                                n.rule.push_str("_linter");
                            }
                        }
                    }
                }
                Err(e) => v
                    .problems
                    .push(problem("syntax", format!("the validator failed: {e}"))),
            }
        }
        let pos = |l: Option<u32>, c: Option<u32>| (l.unwrap_or(0), c.unwrap_or(0));
        v.problems.sort_by_key(|p| pos(p.line, p.column));
        v.warnings.sort_by_key(|p| pos(p.line, p.column));
        v.style.sort_by_key(|s| pos(s.line, s.column));
        v.valid = v.problems.is_empty();
        v
    }

    /// Every installed package a script can `library()`, from the workers'
    /// real library paths (the first library wins, as for `library()`).
    pub fn packages(&self) -> Result<Vec<Package>, PackagesError> {
        let code = "ip <- installed.packages(fields = character()); \
                    ip <- ip[!duplicated(ip[, 'Package']), , drop = FALSE]; \
                    rvisor_result(data.frame(name = unname(ip[, 'Package']), \
                    version = unname(ip[, 'Version']), library = unname(ip[, 'LibPath']), \
                    stringsAsFactors = FALSE))";
        let r = self.run_once(code, &CallOptions::default());
        if r.outcome != Outcome::Complete {
            return Err(PackagesError::Run {
                outcome: r.outcome,
                output: r.console.trim().to_string(),
            });
        }
        let mut list: Vec<Package> = serde_json::from_value(r.result.unwrap_or_default())
            .map_err(|e| PackagesError::List(e.to_string()))?;
        list.sort_by_key(|p| p.name.to_lowercase());
        Ok(list)
    }

    /// Liveness, versions, the live rules, workers and confinement.
    pub fn health(&self) -> Health {
        // The zygote's hello says it (waited for while it starts, a
        // fraction of a second); a worker is started only without one (the
        // validation worker, which then lives as long as the supervisor: a
        // health check is no reason for its memory).
        let r_version = match self.pool().r_version(self.config().worker.startup_timeout) {
            Some(v) => v,
            None => self
                .with_validator(|w| Ok(w.hello().r_version.clone()))
                .unwrap_or_else(|e| format!("unknown ({e})")),
        };
        Health {
            status: "ok".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            r_version,
            uptime_seconds: self.uptime().as_secs_f64(),
            style_engine: self.config().style.as_str().to_string(),
            rules: self.config().rules.clone(),
            workers: self.pool_status(),
            sandbox: self.sandbox().clone(),
        }
    }
}

/// Why the installed packages could not be listed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PackagesError {
    /// The listing run did not complete (no worker, R failed).
    #[error("failed to list the installed packages: the run ended {outcome}: {output}")]
    Run {
        /// How the run ended.
        outcome: Outcome,
        /// What it printed.
        output: String,
    },
    /// R's answer was not a package list.
    #[error("failed to read the package list R gave: {0}")]
    List(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::VariableError;
    use serde_json::json;

    #[test]
    fn names() {
        for ok in ["x", "x1", "my.var", "my_var", ".hidden", ".", "a.b_c"] {
            assert!(syntactic_name(ok), "{ok}");
        }
        for bad in [
            "", "1x", "_x", ".1x", "if", "TRUE", "a-b", "a b", "...", "..1", "é",
        ] {
            assert!(!syntactic_name(bad), "{bad}");
        }
    }

    #[test]
    fn variables() {
        let r = SafetyRules::default();
        let ok = vec![
            ("n".to_string(), json!(3)),
            ("x".to_string(), json!(2.5)),
            ("s".to_string(), json!("a")),
            ("b".to_string(), json!(true)),
            ("v".to_string(), json!([1, 2, 3])),
        ];
        assert!(check_variables(&ok, &r).is_ok());
        for (bad, why) in [
            (json!(null), "null"),
            (json!([1, null]), "null"),
            (json!([1, "a"]), "mixes"),
            (json!([[1]]), "nested"),
            (json!({"a": 1}), "object"),
        ] {
            let e = check_variables(&[("x".to_string(), bad)], &r)
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{e}");
        }
        let many: Vec<_> = (0..51).map(|i| (format!("v{i}"), json!(i))).collect();
        assert_eq!(
            check_variables(&many, &r),
            Err(VariableError::TooMany { given: 51, max: 50 })
        );
        assert!(check_variables(&[("1x".into(), json!(1))], &r)
            .unwrap_err()
            .to_string()
            .contains("syntactic"));
    }
}
