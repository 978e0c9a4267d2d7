//! The HTTP routes of packages: what a tenant can load and may install
//! (`GET /v1/packages`), and installing into its library
//! (`POST /v1/packages/install`); the rules are the service's
//! (`service::packages`, docs/packages.md).

use super::{blocking, ApiError, ApiJson, Handlers, Tenant};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// A package of a tenant's library.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct TenantPackage {
    /// Package name.
    pub name: String,
    /// Version.
    pub version: String,
    /// The repository it came from.
    pub repository: String,
    /// Whether the build came from the shared build cache.
    pub cached: bool,
    /// Whether it was asked for (false: a dependency).
    pub requested: bool,
}

/// The answer of GET /v1/packages.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct PackagesBody {
    /// The packages of R's own libraries (base, recommended, site).
    pub packages: Vec<rvisor::ops::Package>,
    /// The packages this tenant installed (its library, after R's own).
    pub tenant_packages: Vec<TenantPackage>,
    /// What may be installed, from where, within which caps (as health's
    /// `package_install`); null when installing is off.
    #[schema(value_type = Option<Object>)]
    pub install: Option<serde_json::Value>,
}

#[utoipa::path(get, path = "/v1/packages", tag = "operations", responses((status = 200, description = "The packages a script can `library()`: R's own, the tenant's, and what the tenant may install", body = PackagesBody)))]
pub(super) async fn packages(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let report = blocking(move || svc.packages_report(&tenant)).await??;
    Ok(Json(report).into_response())
}

/// The body of POST /v1/packages/install: `packages` or `lockfile`.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InstallBody {
    /// Package names (dependencies come with them), at most 100.
    #[serde(default)]
    #[schema(value_type = Option<Vec<String>>, min_items = 1, max_items = 100)]
    pub packages: Option<serde_json::Value>,
    /// A lockfile (as GET /v1/packages/lockfile answers): exactly those
    /// versions, from the repositories' index.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub lockfile: Option<serde_json::Value>,
}

/// The answer of POST /v1/packages/install.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct InstallAnswer {
    /// What was installed, dependencies included; empty when everything
    /// was there already at the version asked for.
    pub installed: Vec<TenantPackage>,
}

#[utoipa::path(post, path = "/v1/packages/install", tag = "operations", request_body = InstallBody, responses((status = 200, description = "Installed into the tenant's library (sessions and runs of the tenant see it after R's own libraries); on an error (`package`, with `details.reason`) the library is unchanged; 404 `not_found` when the server installs no packages (no `--package-repo`)", body = InstallAnswer)))]
pub(super) async fn packages_install(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiJson(b): ApiJson<InstallBody>,
) -> Result<Response, ApiError> {
    let mut request = serde_json::Map::new();
    if let Some(p) = b.packages {
        request.insert("packages".into(), p);
    }
    if let Some(l) = b.lockfile {
        request.insert("lockfile".into(), l);
    }
    let svc = st.service.clone();
    let installed =
        blocking(move || svc.install_request(&tenant, &serde_json::Value::Object(request)))
            .await??;
    Ok(Json(json!({ "installed": installed })).into_response())
}

/// A tenant library as a lockfile.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct LockfileBody {
    /// 1.
    pub lockfile_version: u32,
    /// R's `major.minor` the packages were built for.
    pub r_version: String,
    /// R's platform.
    pub platform: String,
    /// Name, version, repository and tarball SHA-256 of each package,
    /// dependencies first.
    #[schema(value_type = Vec<Object>)]
    pub packages: Vec<serde_json::Value>,
}

#[utoipa::path(get, path = "/v1/packages/lockfile", tag = "operations", responses((status = 200, description = "The tenant's library as a lockfile; POST it to /v1/packages/install as `lockfile` to make the same library again (here, for another tenant, or on another server with the same repositories)", body = LockfileBody)))]
pub(super) async fn packages_lockfile(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let lock = blocking(move || svc.package_lockfile(&tenant)).await??;
    Ok(Json(lock).into_response())
}
