"""The cache store: its layout (layout), the locks between processes (locks), the manifest codec
(manifest), entry signatures (signing), the content-addressed store (store), the write journal
(journal), folder trees copied in and out of entries (trees), what a miss differs in from the nearest
entry (explain) and verify, gc and rm (manage)."""
