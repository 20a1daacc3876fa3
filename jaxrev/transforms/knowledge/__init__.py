"""What one walk knows and notes: its context, run-time checks, element regions, values known on
some elements, and the record of recovery steps."""
