"""Developer tools beside the product (not installed): tools/README.md."""
