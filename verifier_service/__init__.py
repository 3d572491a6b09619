"""The verifier service: the target model checks draft tokens."""
