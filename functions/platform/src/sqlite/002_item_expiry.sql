-- Expired items are removed, not only hidden (see store.rs `remove_expired`): this finds them without a scan.
CREATE INDEX items_by_expiry ON items (expires_ms) WHERE expires_ms IS NOT NULL;
