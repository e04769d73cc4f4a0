"""Evidence about answers: what an answer is, how answers are compared and how far they agree, and replaying one
record or a slice of them, probing one request, and studying a prompt set (docs/evidence.md)."""
