"""What the tests share: the CLI in a subprocess, the S3 server on loopback, processes, damage to files."""
