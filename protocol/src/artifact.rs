//! Run artifacts: the files a call wrote, as a result lists them
//! (`RunResult::artifacts`; docs/files.md says which files count).

use serde::{Deserialize, Serialize};

/// One file a call wrote (new or changed in its working directory).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Artifact {
    /// Its path relative to the working directory (`out/fig.pdf`).
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// From its extension (`application/octet-stream` when unknown).
    pub media_type: String,
    /// SHA-256 of its bytes, lowercase hex.
    pub sha256: String,
    /// Where to fetch it: a path of the server (`/v1/artifacts/...`) for
    /// a one-shot run's stored artifact, or of the session's files
    /// (`/v1/sessions/{id}/files/...`) for a session call's changed file.
    pub uri: String,
}
