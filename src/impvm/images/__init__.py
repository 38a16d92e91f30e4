"""OCI images of impvm built from Debian packages: definitions and lock (:mod:`.spec`), the
builder (:mod:`.build`) and the ``impvm images`` command (:mod:`.cli`)."""
