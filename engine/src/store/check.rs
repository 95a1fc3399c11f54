//! `check_accounting`: the entry table's own check ([`Table::check`]), then what only the store
//! knows: the writes in flight and the records in its logs.
//!
//! [`Table::check`]: super::entry::Table::check

use crate::backend::Backend;

use super::logs::Logs;
use super::Inner;

/// Check `inner`'s accounting against itself and against `logs` (see `Store::check_accounting`).
pub(super) fn check_accounting<V, B: Backend>(inner: &Inner<V>, logs: &Logs<B>) -> Result<(), String> {
    // A key being written (or streamed) may or may not have its new record in the log yet.
    let settled = |k: &[u8]| !inner.writes.contains(k) && !inner.transfers.contains(k);
    inner.table.check(|k| logs.location(k).map(|l| l.len), settled)?;
    inner.writes.check()?;
    if !inner.writes.is_empty() {
        return Ok(()); // records of writes in flight may or may not be in the log yet
    }
    let on_disk = inner.table.iter().filter(|(_, e)| e.disk_bytes > 0).count();
    if logs.len() != on_disk {
        return Err(format!("the log holds {} keys the store does not know of", logs.len()));
    }
    Ok(())
}
