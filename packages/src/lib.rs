//! Packages on demand: install R packages from operator-allowed CRAN-like
//! repositories into per-tenant libraries, built on the host in a builder
//! without network, with a build cache shared between tenants
//! (docs/packages.md).
//!
//! The flow of [`Installer::install`]: the [`Policy`] checks every name;
//! the repositories' `src/contrib/PACKAGES` ([`index`]) are read; the
//! [`resolve`]r takes the closure of `Depends`, `Imports` and `LinkingTo`
//! minus what is installed already; each tarball is downloaded on the
//! host with a byte cap ([`fetch`]), checked against the index's checksum
//! and listed before anything is unpacked ([`tarball`]); the [`cache`] gives
//! a package built before, else the [`build`]er runs `R CMD INSTALL` into a
//! staging library; only when every package is ready are they renamed into
//! the tenant's library, so a failure leaves it unchanged.

pub mod build;
pub mod cache;
pub mod confine;
pub mod error;
pub mod fetch;
pub mod index;
pub mod install;
pub mod policy;
pub mod resolve;
pub mod tarball;

pub use error::PackageError;
pub use install::{Installed, Installer, LockedPackage, Lockfile, RInfo};
pub use policy::{Policy, Repository};
