"""Small shared pieces with no jaxpt dependencies: the filesystem layer, JSON Lines rules, progress display, config field checks and the error classes."""
