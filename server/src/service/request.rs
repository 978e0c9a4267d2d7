//! The requests the service takes, as every surface decodes them: a
//! one-shot run, a new session, a session call, and their parts.

use serde::Deserialize;
use serde_json::Value;

/// A variable bound in R before a one-shot run.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Variable {
    /// A syntactic R name.
    pub name: String,
    /// A number, string, boolean or flat array of one of those.
    pub value: Value,
}

/// A table loaded as a data frame before a one-shot run.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DataframeRef {
    /// The pointer `POST /v1/tables` answered.
    pub data_pointer: String,
    /// The R name it is bound to.
    pub name: String,
}

/// Limits a client may ask for: each at most the server's own.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, serde::Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsRequest {
    /// Address space, MiB.
    #[serde(default, deserialize_with = "whole::opt_u64")]
    pub memory_mb: Option<u64>,
    /// Private disk (tmpfs), MiB.
    #[serde(default, deserialize_with = "whole::opt_u64")]
    pub disk_mb: Option<u64>,
    /// Processes and threads.
    #[serde(default, deserialize_with = "whole::opt_u64")]
    pub processes: Option<u64>,
    /// CPU seconds over the worker's life.
    #[serde(default, deserialize_with = "whole::opt_u64")]
    pub cpu_seconds: Option<u64>,
}

/// A one-shot run: a fresh worker, variables and tables bound first,
/// validated before anything runs.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunScript {
    /// The R script.
    pub script: String,
    /// Wall and CPU time limit, seconds (the rules' range; default from the
    /// rules).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Variables bound before the script runs.
    #[serde(default, deserialize_with = "objects::vec")]
    pub variables: Vec<Variable>,
    /// Tables loaded as data frames before the script runs.
    #[serde(default, deserialize_with = "objects::vec")]
    pub dataframes: Vec<DataframeRef>,
    /// Tighter confinement limits for this run (never looser than the
    /// server's).
    #[serde(default, deserialize_with = "objects::opt")]
    pub limits: Option<LimitsRequest>,
    /// Rich results (tables as HTML, Markdown and a JSON preview; HTML
    /// values; plot formats): docs/output-and-plots.md, "Displays".
    #[serde(default, deserialize_with = "objects::opt")]
    pub display: Option<rvisor::DisplayOptions>,
    /// Files placed in the run's working directory before the script
    /// runs (inline, base64; docs/files.md). The files the script writes
    /// come back as the result's `artifacts`.
    #[serde(default, deserialize_with = "objects::vec")]
    pub files: Vec<super::artifacts::InputFile>,
}

/// Options of a new session.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, serde::Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSession {
    /// Time limit per call, seconds (the rules' range).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Tighter confinement limits for this session's workers.
    #[serde(default, deserialize_with = "objects::opt")]
    pub limits: Option<LimitsRequest>,
    /// Plot width in pixels.
    #[serde(default, deserialize_with = "whole::opt_u32")]
    pub plot_width: Option<u32>,
    /// Plot height in pixels.
    #[serde(default, deserialize_with = "whole::opt_u32")]
    pub plot_height: Option<u32>,
    /// Rich results (tables as HTML, Markdown and a JSON preview; HTML
    /// values; plot formats): docs/output-and-plots.md, "Displays".
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "objects::opt"
    )]
    pub display: Option<rvisor::DisplayOptions>,
}

/// One call in a session.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionRun {
    /// The R code: not blank, at most 256 KiB.
    pub code: String,
    /// Time limit for this call, seconds (the session's otherwise).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Plot width in pixels for this call (the session's otherwise).
    #[serde(default, deserialize_with = "whole::opt_u32")]
    pub plot_width: Option<u32>,
    /// Plot height in pixels for this call (the session's otherwise).
    #[serde(default, deserialize_with = "whole::opt_u32")]
    pub plot_height: Option<u32>,
    /// Display options for this call, over the session's field by field.
    #[serde(default, deserialize_with = "objects::opt")]
    pub display: Option<rvisor::DisplayOptions>,
}

/// Serde helpers for whole numbers: JSON may spell one `3` or `3.0`, and
/// JSON Schema (so the OpenAPI document's `integer`) calls both integers.
mod whole {
    use serde::de::{self, Deserializer, Visitor};
    use std::fmt;

    struct Whole(u64);

    impl<'de> Visitor<'de> for Whole {
        type Value = Option<u64>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "a whole number from 0 to {} (or null)", self.0)
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            if v <= self.0 {
                Ok(Some(v))
            } else {
                Err(E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            match u64::try_from(v) {
                Ok(v) => self.visit_u64(v),
                Err(_) => Err(E::invalid_value(de::Unexpected::Signed(v), &self)),
            }
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            // `u64::MAX as f64` is 2^64, itself out of range.
            if v.fract() == 0.0 && v >= 0.0 && v < u64::MAX as f64 {
                self.visit_u64(v as u64)
            } else {
                Err(E::invalid_value(de::Unexpected::Float(v), &self))
            }
        }
    }

    /// Up to `i64::MAX` (the OpenAPI `int64`): no limit needs more.
    pub(super) fn opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        d.deserialize_option(Whole(i64::MAX.unsigned_abs()))
    }

    pub(super) fn opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        let v = d.deserialize_option(Whole(u32::MAX.into()))?;
        // In range by the visitor's bound.
        Ok(v.map(|v| u32::try_from(v).unwrap_or(u32::MAX)))
    }
}

/// Serde helpers for objects: a derived struct also decodes from an array
/// of its fields in order (`[null, null]` as a `LimitsRequest`), which the
/// OpenAPI document does not allow and no client means. These decode a
/// request type from a JSON object only.
pub mod objects {
    use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
    use std::fmt;
    use std::marker::PhantomData;

    /// A `T` that was written as a JSON object.
    #[derive(Debug)]
    pub struct Object<T>(pub T);

    struct ObjectVisitor<T>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
        type Value = Object<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object")
        }

        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Object)
        }
    }

    impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_map(ObjectVisitor(PhantomData))
        }
    }

    struct OptVisitor<T>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for OptVisitor<T> {
        type Value = Option<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object or null")
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            Object::<T>::deserialize(d).map(|o| Some(o.0))
        }
    }

    struct VecVisitor<T>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for VecVisitor<T> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an array of JSON objects")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(Object(v)) = seq.next_element::<Object<T>>()? {
                out.push(v);
            }
            Ok(out)
        }
    }

    /// An optional object: absent or `null` is `None`.
    pub(super) fn opt<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        d.deserialize_option(OptVisitor(PhantomData))
    }

    /// An array of objects.
    pub(super) fn vec<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Vec<T>, D::Error> {
        d.deserialize_seq(VecVisitor(PhantomData))
    }
}
