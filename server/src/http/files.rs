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

#[utoipa::path(get, path = "/v1/sessions/{id}/files/{path}", tag = "files", params(("id" = String, Path, description = "session id"), ("path" = String, Path, description = "the file's path in the working directory"), ("Range" = Option<String>, Header, description = "One byte range (`bytes=a-b`, `bytes=a-`, `bytes=-n`): answered 206 with those bytes; several ranges, another unit or a malformed value: 200 with the whole file")), responses((status = 200, description = "The file's bytes, streamed, with its media type (from its extension), length and `Accept-Ranges: bytes`", content_type = "application/octet-stream", body = String), (status = 206, description = "The bytes of the one range asked for, streamed, with `Content-Range: bytes a-b/size`", content_type = "application/octet-stream", body = String)))]
pub(super) async fn file_get(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    FilePath(id, path): FilePath,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let (info, f) = blocking(move || svc.get_session_file(&tenant, &id, &path)).await??;
    stream_file(info, f, &headers, None)
}

/// What a download's `Range` asks of a file.
#[derive(Debug, PartialEq, Eq)]
enum Wanted {
    /// All of it (no range, several, another unit, a malformed one).
    Whole,
    /// Bytes `start..=end`.
    Part { start: u64, end: u64 },
    /// A range outside the file.
    Unsatisfiable,
}

/// The one range of `value` (a `Range` header) in a file of `size` bytes
/// (RFC 9110 14.1.2): `bytes=a-b`, `bytes=a-`, `bytes=-n`. Several
/// ranges, another unit or a value that does not parse ask for the whole
/// file (a server may ignore a `Range`).
fn parse_range(value: &str, size: u64) -> Wanted {
    let Some(spec) = value.trim().strip_prefix("bytes=") else {
        return Wanted::Whole;
    };
    if spec.contains(',') {
        return Wanted::Whole;
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return Wanted::Whole;
    };
    let num = |s: &str| -> Option<u64> {
        let s = s.trim();
        if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    match (a.trim().is_empty(), b.trim().is_empty()) {
        (true, true) => Wanted::Whole,
        // The last n bytes.
        (true, false) => match num(b) {
            None => Wanted::Whole,
            Some(0) => Wanted::Unsatisfiable,
            Some(_) if size == 0 => Wanted::Unsatisfiable,
            Some(n) => Wanted::Part {
                start: size - n.min(size),
                end: size - 1,
            },
        },
        (false, open) => {
            let Some(start) = num(a) else {
                return Wanted::Whole;
            };
            let end = if open {
                None
            } else {
                match num(b) {
                    Some(e) if e >= start => Some(e),
                    _ => return Wanted::Whole,
                }
            };
            if start >= size {
                return Wanted::Unsatisfiable;
            }
            Wanted::Part {
                start,
                end: end.map_or(size - 1, |e| e.min(size - 1)),
            }
        }
    }
}

/// A file as an answer: streamed in 256 KiB reads, with its media type,
/// length and `Accept-Ranges: bytes`; the whole of it (exactly
/// `info.size` bytes), or the one range `headers` ask for (206, or 416
/// outside the file). An `If-Range` that is not `etag` asks for the whole.
fn stream_file(
    info: rvisor::files::FileInfo,
    f: std::fs::File,
    headers: &HeaderMap,
    etag: Option<&str>,
) -> Result<Response, ApiError> {
    use std::io::Seek;
    use tokio::io::AsyncReadExt;
    let size = info.size;
    let range = headers.get(header::RANGE).and_then(|v| v.to_str().ok());
    let if_range_holds = headers
        .get(header::IF_RANGE)
        .is_none_or(|v| etag.is_some_and(|e| v.as_bytes() == e.as_bytes()));
    let wanted = match range {
        Some(r) if if_range_holds => parse_range(r, size),
        _ => Wanted::Whole,
    };
    let (status, start, len) = match wanted {
        Wanted::Whole => (StatusCode::OK, 0, size),
        Wanted::Part { start, end } => (StatusCode::PARTIAL_CONTENT, start, end - start + 1),
        Wanted::Unsatisfiable => {
            let mut res = ApiError::new(
                ErrorCode::RangeNotSatisfiable,
                format!(
                    "the range {:?} lies outside {:?}, which has {size} bytes; ask for bytes                      within 0-{}, or send no Range for the whole file",
                    range.unwrap_or(""),
                    info.name,
                    size.saturating_sub(1)
                ),
            )
            .into_response();
            if let Ok(v) = header::HeaderValue::from_str(&format!("bytes */{size}")) {
                res.headers_mut().insert(header::CONTENT_RANGE, v);
            }
            return Ok(res);
        }
    };
    let mut f = f;
    if start > 0 {
        f.seek(std::io::SeekFrom::Start(start)).map_err(|e| {
            crate::service::file_error(rvisor::files::FileError::Io {
                what: "read the file",
                source: e,
            })
        })?;
    }
    // Exactly the length announced, even if R is still writing the file.
    let reader = tokio::fs::File::from_std(f).take(len);
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
    let mut res = (
        status,
        [
            (header::CONTENT_TYPE, ct),
            (header::CONTENT_LENGTH, header::HeaderValue::from(len)),
            (
                header::ACCEPT_RANGES,
                header::HeaderValue::from_static("bytes"),
            ),
        ],
        axum::body::Body::from_stream(stream),
    )
        .into_response();
    if status == StatusCode::PARTIAL_CONTENT {
        if let Ok(v) =
            header::HeaderValue::from_str(&format!("bytes {start}-{}/{size}", start + len - 1))
        {
            res.headers_mut().insert(header::CONTENT_RANGE, v);
        }
    }
    Ok(res)
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

#[utoipa::path(get, path = "/v1/artifacts/{execution_id}/{name}", tag = "files", params(("execution_id" = String, Path, description = "the run's execution id"), ("name" = String, Path, description = "the artifact's name, as the result's `artifacts` lists it"), ("Range" = Option<String>, Header, description = "One byte range (`bytes=a-b`, `bytes=a-`, `bytes=-n`): answered 206 with those bytes; several ranges, another unit or a malformed value: 200 with the whole artifact. With `If-Range`, only when it is the artifact's `ETag`")), responses((status = 200, description = "The artifact's bytes from the shared store (any node serves them until the TTL), with its media type, length, `Accept-Ranges: bytes` and `ETag` (its sha256)", content_type = "application/octet-stream", body = String), (status = 206, description = "The bytes of the one range asked for, with `Content-Range: bytes a-b/size` and the `ETag`", content_type = "application/octet-stream", body = String)))]
pub(super) async fn artifact_get(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    FilePath(exec, name): FilePath,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let (a, f) = blocking(move || svc.artifact(&tenant, &exec, &name)).await??;
    let info = rvisor::files::FileInfo {
        name: a.name,
        size: a.size,
        media_type: a.media_type,
        modified: String::new(),
    };
    let etag = format!("\"{}\"", a.sha256);
    let mut res = stream_file(info, f, &headers, Some(&etag))?;
    if let Ok(v) = header::HeaderValue::from_str(&etag) {
        res.headers_mut().insert(header::ETAG, v);
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::{parse_range, Wanted};

    #[test]
    fn one_range_is_read_and_the_rest_ask_for_the_whole_file() {
        let part = |start, end| Wanted::Part { start, end };
        assert_eq!(parse_range("bytes=0-9", 100), part(0, 9));
        assert_eq!(parse_range("bytes=90-200", 100), part(90, 99));
        assert_eq!(parse_range("bytes=10-", 100), part(10, 99));
        assert_eq!(parse_range("bytes=-10", 100), part(90, 99));
        assert_eq!(parse_range("bytes=-500", 100), part(0, 99));
        assert_eq!(parse_range("bytes=99-99", 100), part(99, 99));
        assert_eq!(parse_range("bytes=100-", 100), Wanted::Unsatisfiable);
        assert_eq!(parse_range("bytes=100-200", 100), Wanted::Unsatisfiable);
        assert_eq!(parse_range("bytes=-0", 100), Wanted::Unsatisfiable);
        assert_eq!(parse_range("bytes=0-", 0), Wanted::Unsatisfiable);
        assert_eq!(parse_range("bytes=-1", 0), Wanted::Unsatisfiable);
        for whole in [
            "bytes=0-1,5-6",
            "items=0-1",
            "bytes=5-1",
            "bytes=x-1",
            "bytes=-",
            "bytes=1",
            "bytes=99999999999999999999999-",
        ] {
            assert_eq!(parse_range(whole, 100), Wanted::Whole, "{whole}");
        }
    }
}
