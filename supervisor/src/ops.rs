//! The agent-facing operations besides running code: health (with the live
//! safety rules), installed packages, and validation that runs nothing.
//! Every surface (CLI, HTTP, MCP) answers from these.

use crate::error::VariableError;
use crate::{CallOptions, Outcome, Supervisor};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Which style checker validation uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StyleEngine {
    /// lintr's default linters when lintr is installed, else the built-in set.
    #[default]
    Auto,
    /// The built-in set (line length, `=` assignment, T/F, trailing
    /// whitespace): fast, for validate-fix loops.
    Builtin,
    /// No style notes.
    None,
}

impl StyleEngine {
    fn as_str(self) -> &'static str {
        match self {
            StyleEngine::Auto => "auto",
            StyleEngine::Builtin => "builtin",
            StyleEngine::None => "none",
        }
    }
}

/// Limits an agent must respect; reported by health from the running
/// configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SafetyRules {
    /// Largest script, in bytes.
    pub max_script_bytes: usize,
    /// Deepest nesting of expressions.
    pub max_nesting_depth: u32,
    /// Functions a script may not call or refer to (a first line of
    /// defence with early, explainable feedback; the OS confines).
    pub forbidden_functions: Vec<String>,
    /// Run timeouts.
    pub timeout_seconds: TimeoutRules,
    /// Most data frames one run may hydrate.
    pub max_dataframes: usize,
    /// Most variables one run may bind.
    pub max_variables: usize,
}

/// Timeout default and bounds, in seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TimeoutRules {
    /// Used when a run gives none.
    pub default: u64,
    /// Smallest accepted.
    pub min: u64,
    /// Largest accepted.
    pub max: u64,
}

impl Default for SafetyRules {
    fn default() -> Self {
        Self {
            max_script_bytes: crate::MAX_CODE_BYTES,
            max_nesting_depth: 64,
            forbidden_functions: [
                "system",
                "system2",
                "shell",
                "shell.exec",
                "pipe",
                "dyn.load",
                "dyn.unload",
                "library.dynam",
                ".Internal",
                ".Primitive",
                ".C",
                ".Call",
                ".External",
                ".Fortran",
                "socketConnection",
                "socketAccept",
                "url",
                "download.file",
                "Sys.setenv",
                "Sys.unsetenv",
                "quit",
                "q",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            timeout_seconds: TimeoutRules {
                default: 30,
                min: 1,
                max: 300,
            },
            max_dataframes: 10,
            max_variables: 50,
        }
    }
}

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
    /// The rule, e.g. `line_length`.
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
    /// Which style checker ran: `builtin`, or `lintr <version>` (its
    /// default linters) when lintr is installed.
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
    /// (see [`crate::SupervisorConfig::style`]).
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
            style_engine: "builtin".into(),
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
                    style.as_str(),
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
    pub fn packages(&self) -> Result<Vec<Package>, String> {
        let code = "ip <- installed.packages(fields = character()); \
                    ip <- ip[!duplicated(ip[, 'Package']), , drop = FALSE]; \
                    rvisor_result(data.frame(name = unname(ip[, 'Package']), \
                    version = unname(ip[, 'Version']), library = unname(ip[, 'LibPath']), \
                    stringsAsFactors = FALSE))";
        let r = self.run_once(code, &CallOptions::default());
        if r.outcome != Outcome::Complete {
            return Err(format!(
                "listing packages failed ({}): {}",
                r.outcome,
                r.console.trim()
            ));
        }
        let mut list: Vec<Package> = serde_json::from_value(r.result.unwrap_or_default())
            .map_err(|e| format!("bad package list: {e}"))?;
        list.sort_by_key(|p| p.name.to_lowercase());
        Ok(list)
    }

    /// Liveness, versions, the live rules, workers and confinement.
    pub fn health(&self) -> Health {
        let r_version = self
            .with_validator(|w| Ok(w.hello().r_version.clone()))
            .unwrap_or_else(|e| format!("unknown ({e})"));
        Health {
            status: "ok".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            r_version,
            uptime_seconds: self.uptime().as_secs_f64(),
            rules: self.config().rules.clone(),
            workers: self.pool_status(),
            sandbox: self.sandbox().clone(),
        }
    }
}

/// R's reserved words, which are not valid variable names.
const RESERVED: &[&str] = &[
    "if",
    "else",
    "repeat",
    "while",
    "function",
    "for",
    "next",
    "break",
    "TRUE",
    "FALSE",
    "NULL",
    "Inf",
    "NaN",
    "NA",
    "NA_integer_",
    "NA_real_",
    "NA_character_",
    "NA_complex_",
    "in",
];

/// Whether `name` is a syntactic R name (usable as a variable without
/// backquotes).
pub fn syntactic_name(name: &str) -> bool {
    let b = name.as_bytes();
    let ok_start = match b.first() {
        Some(c) if c.is_ascii_alphabetic() => true,
        Some(b'.') => !matches!(b.get(1), Some(c) if c.is_ascii_digit()),
        _ => false,
    };
    ok_start
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || *c == b'.' || *c == b'_')
        && !RESERVED.contains(&name)
        && !(name.starts_with("..") && name[2..].chars().all(|c| c.is_ascii_digit()))
        && name != "..."
}

/// Checks variables for a run: at most `rules.max_variables`, syntactic
/// names without duplicates, values that are numbers, strings, booleans or
/// flat arrays of one of those (no null anywhere). The error says which
/// variable and why.
pub fn check_variables(
    vars: &[(String, serde_json::Value)],
    rules: &SafetyRules,
) -> Result<(), VariableError> {
    use serde_json::Value as V;
    if vars.len() > rules.max_variables {
        return Err(VariableError::TooMany {
            given: vars.len(),
            max: rules.max_variables,
        });
    }
    let mut seen = std::collections::HashSet::new();
    for (name, value) in vars {
        if !syntactic_name(name) {
            return Err(VariableError::BadName(name.clone()));
        }
        if !seen.insert(name) {
            return Err(VariableError::Duplicate(name.clone()));
        }
        let kind = |v: &V| match v {
            V::Bool(_) => Some(0),
            V::Number(_) => Some(1),
            V::String(_) => Some(2),
            _ => None,
        };
        match value {
            V::Null => return Err(VariableError::Null(name.clone())),
            V::Object(_) => return Err(VariableError::Object(name.clone())),
            V::Array(items) => {
                if items.iter().any(V::is_null) {
                    return Err(VariableError::NullElement(name.clone()));
                }
                let kinds: std::collections::HashSet<_> = items.iter().map(kind).collect();
                if kinds.contains(&None) {
                    return Err(VariableError::Nested(name.clone()));
                }
                if kinds.len() > 1 {
                    return Err(VariableError::Mixed(name.clone()));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
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
