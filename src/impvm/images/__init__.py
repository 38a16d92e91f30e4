"""OCI images of impvm built from Debian packages: definitions (:mod:`.spec`), the lock
(:mod:`.lock`) and cache keys (:mod:`.keys`), the builder (:mod:`.build` and its phases) and the
``impvm images`` command (:mod:`.cli`)."""
