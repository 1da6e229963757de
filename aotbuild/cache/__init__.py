"""The cache store: its layout (layout), the locks between processes (locks), the manifest codec
(manifest), entry signatures (signing), the content-addressed store (store), the write journal
(journal) and folder trees copied in and out of entries (trees)."""
