"""The ground floor: what every layer above reads: configuration and its errors, the content-addressed store, provenance, progress lines, the lifeline to a parent process."""
