//! The HTTP routes of a session's files: list, and PUT, GET, DELETE of
//! one file, streaming both ways (the body goes to the file as it
//! arrives, the file to the answer as it is read; never whole in memory).

use super::{blocking, body_timeout, ApiError, Handlers, Tenant};
use crate::service::ErrorCode;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

/// Bytes of an upload gathered before each write to the file.
const WRITE_BYTES: usize = 1 << 20;

/// The answer of GET /v1/sessions/{id}/files.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct FileList {
    /// The regular files of the session's working directory, by name.
    pub files: Vec<rvisor::files::FileInfo>,
}

/// `{id}` and `{path}` of a file route; a rejection is a JSON 400.
pub struct FilePath(pub String, pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for FilePath {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        match Path::<(String, String)>::from_request_parts(parts, state).await {
            Ok(Path((id, path))) => Ok(FilePath(id, path)),
            Err(e) => Err(ApiError::new(
                ErrorCode::BadRequest,
                format!(
                    "{}; send the id and the file's path percent-encoded (UTF-8)",
                    e.body_text()
                ),
            )),
        }
    }
}

#[utoipa::path(get, path = "/v1/sessions/{id}/files", tag = "files", params(("id" = String, Path, description = "session id")), responses((status = 200, description = "The regular files of the session's working directory (symlinks, FIFOs and devices are not listed), sorted by name", body = FileList)))]
pub(super) async fn files_list(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    super::ApiPath(id): super::ApiPath,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let files = blocking(move || svc.session_files(&tenant, &id)).await??;
    Ok(Json(FileList { files }).into_response())
}

#[utoipa::path(put, path = "/v1/sessions/{id}/files/{path}", tag = "files", params(("id" = String, Path, description = "session id"), ("path" = String, Path, description = "the file's path in the working directory (`data/in.csv`; no leading `/`, no `.` or `..` parts)")), request_body(content = String, content_type = "application/octet-stream", description = "The file's bytes, any content type"), responses((status = 201, description = "Stored (atomically: a temporary file renamed over the target once complete)", body = rvisor::files::FileInfo)))]
pub(super) async fn file_put(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    FilePath(id, path): FilePath,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;
    let limits = *st.service.file_limits();
    let announced = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = announced {
        rvisor::file_rules::check_file_size(&limits, n)
            .map_err(|r| crate::service::file_error(r.into()))?;
    }
    let svc = st.service.clone();
    let mut up = blocking(move || svc.begin_upload(&tenant, &id, &path)).await??;
    let std_file = up
        .file()
        .and_then(|f| f.try_clone().ok())
        .ok_or_else(|| ApiError::new(ErrorCode::Internal, "the upload has no file"))?;
    let mut file = tokio::fs::File::from_std(std_file);
    let storage = |e: std::io::Error| {
        crate::service::file_error(rvisor::files::FileError::Io {
            what: "write the file",
            source: e,
        })
    };
    let mut body = body;
    // Frames are gathered into 1 MiB writes (each write of a tokio file
    // is a trip to the blocking pool): bounded memory, few trips.
    let mut pending: Vec<u8> = Vec::with_capacity(WRITE_BYTES);
    loop {
        let frame = match tokio::time::timeout(st.body_timeout, body.frame()).await {
            Err(_) => return Err(body_timeout(st.body_timeout)),
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    format!("the upload could not be read: {e}"),
                ))
            }
            Ok(Some(Ok(f))) => f,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        up.add(data.len() as u64)?;
        pending.extend_from_slice(&data);
        if pending.len() >= WRITE_BYTES {
            file.write_all(&pending).await.map_err(storage)?;
            pending.clear();
        }
    }
    file.write_all(&pending).await.map_err(storage)?;
    file.flush().await.map_err(storage)?;
    drop(file);
    let svc = st.service.clone();
    let info = blocking(move || svc.commit_upload(up)).await??;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

#[utoipa::path(get, path = "/v1/sessions/{id}/files/{path}", tag = "files", params(("id" = String, Path, description = "session id"), ("path" = String, Path, description = "the file's path in the working directory")), responses((status = 200, description = "The file's bytes, streamed, with its media type (from its extension) and length", content_type = "application/octet-stream", body = String)))]
pub(super) async fn file_get(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    FilePath(id, path): FilePath,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let (info, f) = blocking(move || svc.get_session_file(&tenant, &id, &path)).await??;
    Ok(stream_file(info, f))
}

/// A file as an answer: streamed in 256 KiB reads, exactly `info.size`
/// bytes, with its media type and length.
fn stream_file(info: rvisor::files::FileInfo, f: std::fs::File) -> Response {
    use tokio::io::AsyncReadExt;
    // Exactly the length announced, even if R is still writing the file.
    let reader = tokio::fs::File::from_std(f).take(info.size);
    let stream = futures_util::stream::unfold(reader, |mut r| async move {
        let mut buf = vec![0u8; 256 << 10];
        match r.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok::<_, std::io::Error>(axum::body::Bytes::from(buf)), r))
            }
            Err(e) => Some((Err(e), r)),
        }
    });
    let ct = header::HeaderValue::from_str(&info.media_type)
        .unwrap_or(header::HeaderValue::from_static("application/octet-stream"));
    (
        [
            (header::CONTENT_TYPE, ct),
            (header::CONTENT_LENGTH, header::HeaderValue::from(info.size)),
        ],
        axum::body::Body::from_stream(stream),
    )
        .into_response()
}

#[utoipa::path(delete, path = "/v1/sessions/{id}/files/{path}", tag = "files", params(("id" = String, Path, description = "session id"), ("path" = String, Path, description = "the file's path in the working directory")), responses((status = 204, description = "Deleted")))]
pub(super) async fn file_delete(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    FilePath(id, path): FilePath,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    blocking(move || svc.delete_session_file(&tenant, &id, &path)).await??;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[utoipa::path(get, path = "/v1/artifacts/{execution_id}/{name}", tag = "files", params(("execution_id" = String, Path, description = "the run's execution id"), ("name" = String, Path, description = "the artifact's name, as the result's `artifacts` lists it")), responses((status = 200, description = "The artifact's bytes from the shared store (any node serves them until the TTL), with its media type, length and `ETag` (its sha256)", content_type = "application/octet-stream", body = String)))]
pub(super) async fn artifact_get(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    FilePath(exec, name): FilePath,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let (a, f) = blocking(move || svc.artifact(&tenant, &exec, &name)).await??;
    let info = rvisor::files::FileInfo {
        name: a.name,
        size: a.size,
        media_type: a.media_type,
        modified: String::new(),
    };
    let mut res = stream_file(info, f);
    if let Ok(v) = header::HeaderValue::from_str(&format!("\"{}\"", a.sha256)) {
        res.headers_mut().insert(header::ETAG, v);
    }
    Ok(res)
}
