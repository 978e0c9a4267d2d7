//! The rules requests are checked against: script size, nesting, forbidden
//! functions, timeouts, counts of variables and tables, R names and
//! variable values, and which style checker validation uses. Plain data
//! and pure checks: the supervisor's configuration holds them, health
//! reports them, every surface checks against them.

use crate::error::VariableError;
use serde::{Deserialize, Serialize};

/// Which style checker validation uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StyleEngine {
    /// The default: the fast engine ([`StyleEngine::Fast`]).
    #[default]
    Auto,
    /// lintr's default linters implemented statically in Rust
    /// (`rvisor-lint`, ~1 ms for 100 lines). The core has no grammar: the
    /// service layer (`rvisor-server`'s `Service::validate`) produces these
    /// notes; [`crate::Supervisor::validate`] alone gives none for it.
    #[serde(rename = "rvisor")]
    Fast,
    /// lintr's default linters run by R in the validation worker when lintr
    /// is installed, else the built-in set: the thorough engine and the
    /// fast engine's reference (~1-2 s for 100 lines).
    Lintr,
    /// The built-in set (line length, `=` assignment, T/F, trailing
    /// whitespace) of the worker's R driver.
    Builtin,
    /// No style notes.
    None,
}

impl StyleEngine {
    /// The name used on the command line and in configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            StyleEngine::Auto => "auto",
            StyleEngine::Fast => "rvisor",
            StyleEngine::Lintr => "lintr",
            StyleEngine::Builtin => "builtin",
            StyleEngine::None => "none",
        }
    }

    /// Every engine, for parsers and documentation.
    pub const ALL: [StyleEngine; 5] = [
        StyleEngine::Auto,
        StyleEngine::Fast,
        StyleEngine::Lintr,
        StyleEngine::Builtin,
        StyleEngine::None,
    ];

    /// The engine named `s` (as [`StyleEngine::as_str`] spells it).
    pub fn parse(s: &str) -> Option<StyleEngine> {
        Self::ALL.into_iter().find(|e| e.as_str() == s)
    }

    /// Whether this is the fast (Rust) engine, which the service runs.
    pub fn is_fast(self) -> bool {
        matches!(self, StyleEngine::Auto | StyleEngine::Fast)
    }

    /// What the worker's R driver is asked for: `auto` there means lintr
    /// when installed, else the built-in set. The fast engine asks the
    /// worker for no style at all.
    pub(crate) fn worker_mode(self) -> &'static str {
        match self {
            StyleEngine::Lintr => "auto",
            StyleEngine::Builtin => "builtin",
            StyleEngine::Auto | StyleEngine::Fast | StyleEngine::None => "none",
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

/// The longest name R accepts for a symbol, in bytes (R's `MAXIDSIZE`):
/// a longer one is an R error ("variable names are limited to 10000
/// bytes") as soon as it is bound.
pub const MAX_NAME_BYTES: usize = 10_000;

/// Why `name` cannot be bound as an R variable, if it cannot: too long for
/// R's symbol table, or not a syntactic name. The message names the
/// problem without repeating a long name whole.
pub fn name_problem(name: &str) -> Option<String> {
    if name.len() > MAX_NAME_BYTES {
        let head = cut_name(name);
        return Some(format!(
            "the name {head:?}... is {} bytes long; R limits names to {MAX_NAME_BYTES} bytes",
            name.len()
        ));
    }
    if !syntactic_name(name) {
        return Some(format!(
            "{:?} is not a syntactic R name (letters, digits, '.', '_'; not starting with a \
             digit or '_'; not a reserved word)",
            cut_name(name)
        ));
    }
    None
}

/// The first 40 characters of `name`, for messages.
fn cut_name(name: &str) -> String {
    name.chars().take(40).collect()
}

/// Whether `name` is a syntactic R name (usable as a variable without
/// backquotes) of at most [`MAX_NAME_BYTES`].
pub fn syntactic_name(name: &str) -> bool {
    name.len() <= MAX_NAME_BYTES && rvisor_protocol::names::bare_name(name)
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
        if name.len() > MAX_NAME_BYTES {
            return Err(VariableError::TooLong {
                head: cut_name(name),
                bytes: name.len(),
            });
        }
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
