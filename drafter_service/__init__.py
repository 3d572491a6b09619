"""The drafter service: proposes draft tokens for one session at a time."""
