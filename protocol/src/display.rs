//! Rich results: a value or a plot as a MIME bundle (Jupyter's `display_data`
//! content), and the options that decide which bundles a call makes.
//!
//! A [`Display`] is `{"data": {mime: value}, "metadata": {...}}`, exactly
//! the shape of Jupyter's `display_data` content, so a Jupyter surface sends
//! it as is. Text types are strings, binary types (`image/png`) base64
//! strings, `application/json` a JSON value. `RunResult::displays` lists
//! them in order and a `{"kind": "display", "index": N}` segment marks
//! where each happened (docs/output-and-plots.md, "Displays").

use serde::{Deserialize, Serialize};

/// One rich output: MIME type to value, and metadata about it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Display {
    /// MIME type to value: `text/plain`, `text/html`, `text/markdown`,
    /// `image/svg+xml` (strings), `image/png` (base64), `application/json`
    /// (a JSON value).
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub data: serde_json::Map<String, serde_json::Value>,
    /// About the value: `rvisor.kind` (`table`, `html`, `plot`), its class,
    /// and `rvisor.truncated` (which MIME types were cut or left out at a
    /// cap, and why), `width` and `height` per image type as Jupyter has
    /// them.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// Jupyter's `transient`: `display_id` when the code named one
    /// (`rvisor_display(x, display_id = "...")`), so that a later display
    /// with the same id can replace this one where it is shown. Absent
    /// when empty.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub transient: serde_json::Map<String, serde_json::Value>,
    /// This display replaces the one shown earlier with the same
    /// `transient.display_id` (`rvisor_display(x, display_id = "...",
    /// update = TRUE)`; Jupyter's `update_display_data`) instead of being
    /// shown as a new output. Absent when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub update: bool,
}

impl Display {
    /// The display's `transient.display_id`, if it has one.
    pub fn display_id(&self) -> Option<&str> {
        self.transient.get("display_id").and_then(|v| v.as_str())
    }

    /// Roughly the bytes it holds: its values (strings as they are, JSON
    /// values as text) and its metadata and transient as JSON text. What a
    /// streamed display event is counted for against a stream's bound.
    pub fn size_bytes(&self) -> usize {
        fn value(v: &serde_json::Value) -> usize {
            match v {
                serde_json::Value::String(s) => s.len(),
                other => other.to_string().len(),
            }
        }
        let map = |m: &serde_json::Map<String, serde_json::Value>| -> usize {
            m.iter().map(|(k, v)| k.len() + value(v)).sum()
        };
        map(&self.data) + map(&self.metadata) + map(&self.transient)
    }
}

/// Default rows of a table shown as HTML, Markdown and the JSON preview: a
/// table of 20 rows and 20 columns of Markdown is a few KiB, which a
/// model's context affords in every call.
pub const DEFAULT_MAX_ROWS: u32 = 20;
/// Default columns of a table shown as HTML and Markdown.
pub const DEFAULT_MAX_COLS: u32 = 20;
/// Largest `max_rows` / `max_cols` accepted.
pub const MAX_TABLE_SIDE: u32 = 10_000;
/// Default cap on the HTML of one value (a self-contained plotly widget
/// is about 3.6 MiB, a DT table about 1 MiB).
pub const DEFAULT_HTML_MAX_BYTES: u64 = 5 * 1024 * 1024;

/// The largest `html_max_bytes` a request may give (1 GiB): an HTML display
/// also counts against the call's output cap, so more is never kept.
pub const MAX_HTML_MAX_BYTES: u64 = 1 << 30;
/// Bytes of `text/plain` kept in a display (the console keeps what R
/// printed, under the output cap).
pub const TEXT_PLAIN_BYTES: usize = 64 * 1024;
/// Displays kept per call (values; plots are bounded by their own cap).
pub const MAX_DISPLAYS: usize = 64;

/// The image formats of plot pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum PlotFormat {
    /// PNG only (as before displays existed).
    #[default]
    Png,
    /// SVG only (`plots` then carries the SVG pages, mime `image/svg+xml`).
    Svg,
    /// Both: `plots` carries the PNG, the display of each page both.
    Both,
}

impl PlotFormat {
    /// Whether PNG pages are made.
    pub fn png(self) -> bool {
        matches!(self, PlotFormat::Png | PlotFormat::Both)
    }
    /// Whether SVG pages are made.
    pub fn svg(self) -> bool {
        matches!(self, PlotFormat::Svg | PlotFormat::Both)
    }
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            PlotFormat::Png => "png",
            PlotFormat::Svg => "svg",
            PlotFormat::Both => "both",
        }
    }
}

/// What rich results a call makes; every field optional, so a session's
/// options and a call's overrides merge field by field ([`Self::over`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DisplayOptions {
    /// Make displays of values (tables, HTML-only values) and plots;
    /// default true. False: values print as text only, an HTML-only value
    /// ends the call `unsupported_output` as before, plots only in `plots`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Rows of a table in HTML, Markdown and the JSON preview (default 20).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rows: Option<u32>,
    /// Columns of a table in HTML and Markdown (default 20).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cols: Option<u32>,
    /// Most bytes of one value's HTML (default 5 MiB); past it the HTML is
    /// left out and `metadata.rvisor.truncated` says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub html_max_bytes: Option<u64>,
    /// Image formats of plot pages: `png` (default), `svg` or `both`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plot_format: Option<PlotFormat>,
    /// Visible top-level values as displays too (default false): each
    /// value R would print at its prompt becomes a display whose
    /// `text/plain` is exactly what R prints, kept out of the console
    /// stream (a table's bundle carries it), `metadata.rvisor.kind`
    /// `value` (`table`, `html` for those), and the last visible value of
    /// the call marked `metadata.rvisor.last: true`. Jupyter's
    /// `execute_result` is built from it; other surfaces leave it off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub values: Option<bool>,
}

impl DisplayOptions {
    /// `self` with each field `over` sets replaced by its value.
    pub fn over(self, over: &DisplayOptions) -> DisplayOptions {
        DisplayOptions {
            enabled: over.enabled.or(self.enabled),
            max_rows: over.max_rows.or(self.max_rows),
            max_cols: over.max_cols.or(self.max_cols),
            html_max_bytes: over.html_max_bytes.or(self.html_max_bytes),
            plot_format: over.plot_format.or(self.plot_format),
            values: over.values.or(self.values),
        }
    }
    /// Whether visible values become displays (default false; only with
    /// displays enabled).
    pub fn values(&self) -> bool {
        self.enabled() && self.values.unwrap_or(false)
    }
    /// Whether displays are made (default true).
    pub fn enabled(&self) -> bool {
        self.enabled.unwrap_or(true)
    }
    /// Rows shown (default [`DEFAULT_MAX_ROWS`]).
    pub fn max_rows(&self) -> u32 {
        self.max_rows.unwrap_or(DEFAULT_MAX_ROWS)
    }
    /// Columns shown (default [`DEFAULT_MAX_COLS`]).
    pub fn max_cols(&self) -> u32 {
        self.max_cols.unwrap_or(DEFAULT_MAX_COLS)
    }
    /// The HTML cap (default [`DEFAULT_HTML_MAX_BYTES`]).
    pub fn html_max_bytes(&self) -> u64 {
        self.html_max_bytes.unwrap_or(DEFAULT_HTML_MAX_BYTES)
    }
    /// The plot format (default PNG).
    pub fn plot_format(&self) -> PlotFormat {
        self.plot_format.unwrap_or_default()
    }
    /// Why these options cannot be used, if they cannot: each limit must
    /// be between 1 and its maximum.
    pub fn problem(&self) -> Option<String> {
        for (name, v) in [("max_rows", self.max_rows), ("max_cols", self.max_cols)] {
            if let Some(v) = v {
                if v == 0 || v > MAX_TABLE_SIDE {
                    return Some(format!(
                        "display.{name} is {v}; it must be between 1 and {MAX_TABLE_SIDE}"
                    ));
                }
            }
        }
        if let Some(v) = self.html_max_bytes {
            if v == 0 || v > MAX_HTML_MAX_BYTES {
                return Some(format!(
                    "display.html_max_bytes is {v}; it must be between 1 and {MAX_HTML_MAX_BYTES}"
                ));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_shaped_like_jupyter_display_data() {
        let mut d = Display::default();
        d.data.insert("text/plain".into(), "[1] 2".into());
        d.data
            .insert("application/json".into(), serde_json::json!({"rows": 1}));
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(v["data"]["text/plain"], "[1] 2");
        assert_eq!(v["data"]["application/json"]["rows"], 1);
        assert!(v["metadata"].as_object().unwrap().is_empty());
        assert_eq!(serde_json::from_value::<Display>(v).unwrap(), d);
    }

    #[test]
    fn options_merge_field_by_field_and_check_their_limits() {
        let session = DisplayOptions {
            max_rows: Some(5),
            plot_format: Some(PlotFormat::Svg),
            ..Default::default()
        };
        let call = DisplayOptions {
            max_rows: Some(7),
            enabled: Some(false),
            ..Default::default()
        };
        let m = session.over(&call);
        assert_eq!(m.max_rows(), 7);
        assert!(!m.enabled());
        assert_eq!(m.plot_format(), PlotFormat::Svg);
        assert_eq!(m.max_cols(), DEFAULT_MAX_COLS);
        assert!(DisplayOptions::default().enabled());
        let bad = DisplayOptions {
            max_cols: Some(0),
            ..Default::default()
        };
        assert!(bad.problem().unwrap().contains("display.max_cols is 0"));
        assert!(serde_json::from_str::<DisplayOptions>(r#"{"rows": 3}"#).is_err());
        let f: DisplayOptions = serde_json::from_str(r#"{"plot_format": "both"}"#).unwrap();
        assert!(f.plot_format().png() && f.plot_format().svg());
        assert!(!DisplayOptions::default().values());
        let v: DisplayOptions = serde_json::from_str(r#"{"values": true}"#).unwrap();
        assert!(v.values() && DisplayOptions::default().over(&v).values());
        let off = DisplayOptions {
            enabled: Some(false),
            ..v
        };
        assert!(!off.values(), "values need displays");
    }
}
