"""Image signatures: the pinned cosign CLI and the fingerprint of a public key, shared by the
agent (verification), the operator (the template's key check) and the image build."""
