"""Evidence about answers: what an answer is, and how answers are compared, replayed and probed."""
