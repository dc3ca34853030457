"""Prompt text with an exact token count, and shared prefixes that really share.

The bench must send prompts of exactly the length the workload asks for, as the target's own
tokenizer counts them, or every KV-cache figure downstream is off. Text is built from a pool of
common English words that the tokenizer has verified to cost exactly one token each wherever
they stand in a space-separated sequence; a prompt of N tokens is then the fixed overhead of
the tokenizer (BOS, chat template) plus N minus that many words, and every prompt is checked
with the counter once more before it is used.

Where the first word of a text is tokenized unlike the rest (a chat template that puts the
content right after a tag, with no space before it), every prompt starts with the same fixed
lead word, whose cost becomes part of the overhead.

Shared prefixes: a request's `prefix_blocks` (Mooncake's hash_ids) name blocks of
`block_tokens` words each, drawn from a generator seeded by (seed, block id). Two requests
whose block lists start alike therefore start with the very same words, and since each word is
one token, the same token ids: vLLM's prefix cache finds them.

The counter is any callable `str -> int`; `bench.counting` builds one from the project's
TokenCounter or from a vLLM server's `/tokenize`. This module does no I/O itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.workload import RequestSpec

CountTokens = Callable[[str], int]
"""Tokens the target will count for a prompt made of this text (for the chosen API)."""

# Common lowercase words; most are one token in the usual 32k-100k vocabularies. The pool is
# filtered against the real tokenizer, so words that split are simply dropped.
_CANDIDATE_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at
    which but have an they you were her she there one all we their has been would when who
    will more if no out so said what up its about into than them can only other new some
    time could these two may then do first any my now such like our over man me even most
    made after also did many before must through back years where much your way well down
    should because each just those people how too little state good very make world still
    own see men work long get here between both life being under never day same another know
    while last might us great old year off come since against go came right used take three
    states himself few house use during without again place around however home small found
    thought went say part once general high upon school every does got united left number
    course war until always away something fact though water less public put think almost
    hand enough far took head yet government system better set told nothing night end why
    called didn find look asked going later knew point next program city business give group
    toward young days let room president side social given present several order national
    possible rather second face per among form important often things looked early white case
    john become large big need four within felt along children saw best church ever least power
    development light thing seemed family interest want members mind country area others done
    turned although open god service problem certain kind different thus began door help means
    sense whole matter perhaps itself york times law human line above name example action
    company hands local show whether five history gave today either act feet across taken past
    quite anything seen having death week experience body word half really field am car words
    already themselves information tell together college shall money period held keep sure free
    real probably seems political cannot behind miss question air office making brought whose
    special heard major problems ago became federal moment study available known result street
    economic boy reason position change south board individual job areas society west close
    turn love community true court force full seem am cost wife future age wanted department
    voice center woman control common necessary following front sometimes six girl clear
    further land run students provide feel party able mother music education university child
    effect level stood military short town morning total outside rate figure class art century
    washington north usually leave therefore evidence percent black plan strong market value
    """
CANDIDATE_WORDS: tuple[str, ...] = tuple(_CANDIDATE_TEXT.split())

# Pool sizes: enough words that prompts do not repeat, few enough to filter quickly.
MIN_POOL_WORDS = 32
# Random word sequences whose counts must all show the same overhead.
VERIFY_SAMPLE_SIZES = (1, 2, 7, 48, 96, 96)
MAX_FIXUP_ROUNDS = 4


class PromptError(RuntimeError):
    """The tokenizer does not let the bench build prompts of exact length."""


@dataclass(slots=True)
class PromptFactory:
    """Builds prompt texts of exact token counts (see the module docstring).

    Not thread-safe (it caches block texts); build all prompts before a run starts.
    """

    count: CountTokens
    words: tuple[str, ...]
    overhead: int
    seed: int
    block_tokens: int
    lead: str = ""
    _blocks: dict[int, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def calibrate(
        cls,
        count: CountTokens,
        *,
        seed: int,
        block_tokens: int,
        candidates: Sequence[str] = CANDIDATE_WORDS,
    ) -> PromptFactory:
        """Keep the candidate words that cost exactly one token each, learn the tokenizer's
        fixed overhead (BOS, template) and check that word costs add up."""
        words = tuple(dict.fromkeys(w for w in candidates if _is_one_token(count, w)))
        if len(words) < MIN_POOL_WORDS:
            raise PromptError(
                f"only {len(words)} of {len(candidates)} candidate words are single tokens "
                "for this tokenizer; cannot build exact-length prompts"
            )
        rng = random.Random(f"{seed}:calibrate")
        samples = [rng.choices(words, k=k) for k in VERIFY_SAMPLE_SIZES]
        for lead in ("", words[0]):
            prefix = [lead] if lead else []
            overheads = {count(" ".join(prefix + sample)) - len(sample) for sample in samples}
            if len(overheads) == 1 and min(overheads) >= 0:
                return cls(
                    count=count,
                    words=words,
                    overhead=overheads.pop(),
                    seed=seed,
                    block_tokens=max(1, block_tokens),
                    lead=lead,
                )
        raise PromptError("token counts of word sequences are not additive")

    @property
    def min_prompt_tokens(self) -> int:
        """The shortest prompt this tokenizer allows (its overhead plus one word)."""
        return self.overhead + 1

    def _block(self, block_id: int) -> tuple[str, ...]:
        cached = self._blocks.get(block_id)
        if cached is None:
            rng = random.Random(f"{self.seed}:block:{block_id}")
            cached = tuple(rng.choices(self.words, k=self.block_tokens))
            self._blocks[block_id] = cached
        return cached

    def words_for(self, spec: RequestSpec, index: int) -> list[str]:
        """The words of request `index` before checking: its prefix blocks, then words of its
        own (seeded by the index, so distinct requests do not share by accident)."""
        wanted = max(1, spec.prompt_tokens - self.overhead)
        words: list[str] = []
        for block_id in spec.prefix_blocks:
            if len(words) >= wanted:
                break
            words.extend(self._block(block_id))
        if len(words) < wanted:
            rng = random.Random(f"{self.seed}:request:{index}")
            words.extend(rng.choices(self.words, k=wanted - len(words)))
        return words[:wanted]

    def text_for(self, spec: RequestSpec, index: int) -> tuple[str, int]:
        """(text, tokens): the prompt text and its token count as the counter reports it.
        The count equals `spec.prompt_tokens` unless the request asks for fewer tokens than
        `min_prompt_tokens`. A mismatch is repaired at the tail, which no other request
        shares; PromptError when that does not converge."""
        words = self.words_for(spec, index)
        target = max(spec.prompt_tokens, self.min_prompt_tokens)
        rng = random.Random(f"{self.seed}:fixup:{index}")
        lead = [self.lead] if self.lead else []
        for _ in range(MAX_FIXUP_ROUNDS):
            text = " ".join(lead + words)
            tokens = self.count(text)
            diff = target - tokens
            if diff == 0:
                return text, tokens
            if diff > 0:
                words.extend(rng.choices(self.words, k=diff))
            elif len(words) + diff >= 1:
                del words[diff:]
            else:
                break
        raise PromptError(f"request {index}: could not reach {target} prompt tokens (last count {tokens})")


def _is_one_token(count: CountTokens, word: str) -> bool:
    # The marginal cost of the word in a run of itself: immune to BOS and to the special
    # treatment of the first word (SentencePiece's dummy prefix space).
    return count(" ".join([word] * 8)) - count(" ".join([word] * 4)) == 4
