"""A repository on a store: config, manifests and refs (RepoStorage), leases, the gc lock, tags."""
