//! Removing a key: its entry from memory and its record from the log (every put and remove comes
//! here), and dropping a record nobody wants (one whose key was removed or replaced while it was
//! written).

use crate::backend::Backend;
use crate::error::Result;

use super::{key_str, Codec, Inner, Store};

/// Remove `key`'s entry from memory and disk; returns whether it existed. If the log cannot drop
/// the record (a persistent store's tombstone write failed), the entry stays as it was.
pub(super) fn drop_entry<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    key: &[u8],
) -> Result<bool> {
    // Every put and remove comes here. A transfer of the key in progress loses to it (once the
    // old record, if any, is dropped: a remove that fails changes nothing).
    let Some(disk_bytes) = inner.table.get(key).map(|e| e.disk_bytes) else {
        inner.transfers.supersede(key);
        return Ok(false);
    };
    if disk_bytes > 0 {
        if store.cfg.persistent {
            store.logs.current().delete(key)?;
        } else {
            store.logs.forget(key)?;
        }
    }
    inner.transfers.supersede(key);
    inner.table.take(key);
    if disk_bytes > 0 {
        inner.table.unstick();
    }
    Ok(true)
}

/// Drop the record a spill or stream wrote for `key` after the key was removed or replaced
/// meanwhile. A persistent store writes a tombstone; if it cannot (a full disk), the record is
/// forgotten instead, so the store and its log agree for as long as the process lives, and the
/// failure is logged: after a restart the old value could come back.
pub(super) fn drop_stale_record<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8]) {
    if store.cfg.persistent {
        match store.logs.current().delete(key) {
            Ok(_) => return,
            Err(e) => log::error!(
                "Failed to delete the record of {:?}, removed while it was written ({e}); forgetting it instead, so it may come back after a restart",
                key_str(key)
            ),
        }
    }
    if let Err(e) = store.logs.forget(key) {
        log::error!("Failed to drop the record of {:?}, removed while it was written: {e}", key_str(key));
    }
}

/// Take `key`'s entry out of memory only: its record (if any) stays in the log, for a new record
/// of the key about to be written there, which supersedes it (a persistent store's `put_large`:
/// until the new record is written, a crash leaves the old value, not neither). Once that write
/// is settled, [`drop_superseded_record`] drops the old record if the new one did not replace it.
pub(super) fn take_entry_keeping_record<V>(inner: &mut Inner<V>, key: &[u8]) {
    inner.transfers.supersede(key);
    if inner.table.take(key).is_some_and(|old| old.disk_bytes > 0) {
        inner.table.unstick();
    }
}

/// After the write that [`take_entry_keeping_record`] kept `key`'s old record for: if the key's
/// entry has no record of its own (the new one was refused or failed, or a put or remove replaced
/// the entry meanwhile) and the log still holds one, that is the old record, which nothing wants
/// any more: it is dropped (a tombstone in a persistent store, see [`drop_stale_record`]).
pub(super) fn drop_superseded_record<C: Codec, B: Backend>(store: &Store<C, B>, inner: &Inner<C::Value>, key: &[u8]) {
    let has_record = inner.table.get(key).is_some_and(|e| e.disk_bytes > 0);
    if !has_record && store.logs.location(key).is_some() {
        drop_stale_record(store, key);
    }
}
