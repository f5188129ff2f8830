"""Small shared pieces with no jaxpt dependencies: the filesystem layer, JSON Lines rules, progress display, config field checks, the error classes and the command-line flag grammar (cli)."""
