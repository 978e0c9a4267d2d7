//! The table store as the service offers it to every surface.

use super::{Service, ServiceError};
use crate::tables::{TableFormat, TableMeta};
use std::path::PathBuf;

impl Service {
    /// Stores a table for `tenant`.
    pub fn put_table(
        &self,
        tenant: &str,
        format: TableFormat,
        bytes: &[u8],
    ) -> Result<TableMeta, ServiceError> {
        Ok(self.inner.tables.put(tenant, format, bytes)?)
    }

    /// Stores the upload spooled in file `src` for `tenant` (bounded
    /// memory; see `TableStore::put_file`).
    pub fn put_table_file(
        &self,
        tenant: &str,
        format: TableFormat,
        src: &std::path::Path,
    ) -> Result<TableMeta, ServiceError> {
        Ok(self.inner.tables.put_file(tenant, format, src)?)
    }

    /// A fresh spool path for an upload on its way in (the caller removes
    /// it).
    pub fn spool_path(&self) -> PathBuf {
        self.inner.tables.spool_path()
    }

    /// A table's metadata.
    pub fn get_table(&self, tenant: &str, pointer: &str) -> Result<TableMeta, ServiceError> {
        self.inner
            .tables
            .get(tenant, pointer)
            .ok_or_else(|| ServiceError::not_found("table"))
    }

    /// Deletes a table.
    pub fn delete_table(&self, tenant: &str, pointer: &str) -> Result<(), ServiceError> {
        if self.inner.tables.delete(tenant, pointer) {
            Ok(())
        } else {
            Err(ServiceError::not_found("table"))
        }
    }
}
