"""The decision policy (bot/decision.py), the head's training and calibration (bot/classifier.py),
and safety-net lines (safety/safety_net.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bot.classifier import HELD_OUT, LABELS, MEMBERS, expected_calibration_error, fit_head, held_out_mask
from bot.decision import DecisionConfig, decide
from bot.types import Intent
from safety.normalize import normalize
from safety.safety_net import safety_net

CFG = DecisionConfig()


def probs(**given: float) -> dict[str, float]:
    """A probability for every label: the given ones, the rest sharing what is left."""
    rest = (1.0 - sum(given.values())) / (len(LABELS) - len(given))
    return {label: given.get(label, rest) for label in LABELS}


def run(p: dict[str, float], rule=None, scope=False, care_team=False, off_topic=None, confidence=0.9, fit=0.8):
    return decide(p, CFG, rule=rule, scope=scope, care_team=care_team, off_topic=off_topic,
                  retrieval_confidence=confidence, min_confidence=0.5, topic_fit=fit)


def test_likely_danger_is_the_emergency_reply_and_crisis_when_self_harm_is_likelier():
    assert run(probs(emergency=0.85, answer=0.1)).intent is Intent.EMERGENCY
    d = run(probs(crisis=0.6, emergency=0.25, answer=0.1))
    assert d.intent is Intent.EMERGENCY and d.kind == "crisis"
    d = run(probs(crisis=0.55, answer=0.4))  # a wish not to wake up never gets sleep tips
    assert d.intent is Intent.EMERGENCY and d.kind == "crisis"


def test_possible_danger_keeps_the_answer_and_adds_a_safety_net():
    d = run(probs(emergency=0.2, answer=0.7))
    assert d.intent is Intent.ANSWER and d.safety_net == "emergency" and d.fit == pytest.approx(0.8)
    assert run(probs(emergency=0.05, answer=0.9)).safety_net == ""


def test_the_crisis_line_needs_crisis_net_and_a_weaker_crisis_reading_adds_no_line():
    """'what's a good breakfast' read at P(crisis) 0.15 must not get the suicide-line sentence (decision.crisis_net)."""
    assert run(probs(crisis=0.3, answer=0.6)).safety_net == "crisis"
    assert run(probs(crisis=0.15, emergency=0.02, answer=0.8)).safety_net == ""
    assert run(probs(crisis=0.15, emergency=0.13, answer=0.7)).safety_net == "emergency"


def test_below_danger_answer_the_answer_is_judged_among_the_non_danger_labels():
    d = run(probs(emergency=0.45, answer=0.4))  # a bee sting with no other symptoms: 0.4 / 0.55 = 0.73
    assert d.intent is Intent.ANSWER and d.safety_net == "emergency"
    d = run(probs(emergency=0.7, answer=0.25))  # 0.25 / 0.3 = 0.83, but danger is likelier than not
    assert d.intent is Intent.NO_ANSWER and d.safety_net == "emergency"
    assert run(probs(emergency=0.3, answer=0.3, no_answer=0.3)).intent is Intent.NO_ANSWER  # 0.3 / 0.7 = 0.43


def test_an_answer_needs_the_head_retrieval_confidence_and_no_nearer_non_answer_example():
    assert run(probs(answer=0.9)).intent is Intent.ANSWER
    assert run(probs(answer=0.9), confidence=0.3).intent is Intent.NO_ANSWER
    assert run(probs(answer=0.9), off_topic="no_answer").intent is Intent.NO_ANSWER
    assert run(probs(answer=0.4, no_answer=0.5)).intent is Intent.NO_ANSWER


def test_an_answer_needs_a_topic_that_fits_the_question():
    d = run(probs(answer=0.95), fit=0.2)  # health, answerable in kind, but the best topic is about something else
    assert d.intent is Intent.NO_ANSWER and d.source == "topic_fit" and d.fit == pytest.approx(0.2)
    d = run(probs(answer=0.95), fit=CFG.topic_fit)
    assert d.intent is Intent.ANSWER and d.fit == pytest.approx(CFG.topic_fit)


def test_a_topic_only_the_prior_ranks_first_needs_a_surer_fit_and_is_offered_below_it():
    fit = (CFG.topic_fit + CFG.topic_fit_contested) / 2
    assert run(probs(answer=0.95), fit=fit).intent is Intent.ANSWER
    d = decide(probs(answer=0.95), CFG, rule=None, scope=False, care_team=False, off_topic=None,
               retrieval_confidence=0.9, min_confidence=0.5, topic_fit=fit, contested=True)
    assert d.intent is Intent.NO_ANSWER and d.source == "topic_fit" and d.offer
    d = decide(probs(answer=0.95), CFG, rule=None, scope=False, care_team=False, off_topic=None,
               retrieval_confidence=0.9, min_confidence=0.5, topic_fit=CFG.topic_fit_contested, contested=True)
    assert d.intent is Intent.ANSWER


def test_rules_keep_their_say_and_the_head_adds_what_rules_miss():
    assert run(probs(answer=0.9), rule=Intent.GREETING).intent is Intent.GREETING
    assert run(probs(answer=0.9), scope=True).intent is Intent.REFER_DOCTOR
    d = run(probs(answer=0.9), care_team=True)  # after surgery, a diet for a named disease: the care team's, not ours
    assert d.intent is Intent.NO_ANSWER and d.source == "rule"
    assert run(probs(handoff=0.8)).intent is Intent.HANDOFF
    assert run(probs(greeting=0.8)).intent is Intent.GREETING
    assert run(probs(refer_doctor=0.7, answer=0.2)).intent is Intent.REFER_DOCTOR
    assert run(probs(out_of_scope=0.7)).intent is Intent.OUT_OF_SCOPE


def test_training_is_deterministic_and_the_report_says_how_calibrated_it_is():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(len(LABELS), 16))
    y = np.repeat(np.arange(len(LABELS)), 40)
    x = centres[y] + rng.normal(scale=1.5, size=(len(y), 16))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    texts = [f"line {i}" for i in range(len(y))]
    a, b = fit_head(x, y, texts), fit_head(x, y, texts)
    np.testing.assert_array_equal(a[0].w1, b[0].w1)
    net, temperature, report = a
    assert net.w1.shape == (16, 256 * MEMBERS) and net.logits(x[:3]).shape == (3, len(LABELS))
    assert report["held_out"] == held_out_mask(texts).sum() and set(report["recall"]) == set(LABELS)
    assert report["log_loss"]["calibrated"] <= report["log_loss"]["raw"] + 1e-9
    assert 0.0 <= report["ece"]["calibrated"] <= 1.0 and temperature > 0


def test_lines_added_to_the_training_data_move_no_other_line_in_or_out_of_the_held_out_fifth():
    texts = [f"第{i}行 头疼怎么办" for i in range(5000)]
    before, after = held_out_mask(texts), held_out_mask(texts[:2000] + ["新加的一行", "another new line"] + texts[2000:])
    np.testing.assert_array_equal(np.delete(after, [2000, 2001]), before)
    assert abs(before.mean() - HELD_OUT) < 0.02


def test_expected_calibration_error_is_zero_when_confidence_matches_accuracy():
    p = np.array([[1.0, 0.0]] * 4)
    assert expected_calibration_error(p, np.zeros(4, dtype=int)) == 0.0
    assert expected_calibration_error(p, np.array([0, 0, 1, 1])) == pytest.approx(0.5)


@pytest.mark.parametrize("text, lang, kind, family, words", [
    ("宝宝发烧 手脚冰凉", "zh", "emergency", "child", "按压不褪色"),
    ("怀孕32周 脚肿得厉害", "zh", "emergency", "pregnancy", "胎动"),
    ("my dad's chest feels tight", "en", "emergency", "heart", "112 / 911"),
    ("i just feel off today", "en", "emergency", "general", "112 / 911"),
    ("活着好累", "zh", "crisis", "crisis", "12356"),
])
def test_safety_net_names_the_warning_signs_that_fit_the_message(text, lang, kind, family, words):
    number = "120" if lang == "zh" else "112 / 911"
    ids, line = safety_net(text, lang, kind, number, "12356" if lang == "zh" else "988")
    assert ids[0] == family and words in line


def test_an_answer_needs_a_topic_that_covers_the_population_or_disease_named():
    assert run(probs(answer=0.9)).intent is Intent.ANSWER
    d = decide(probs(answer=0.9), CFG, rule=None, scope=False, care_team=False, off_topic=None,
               retrieval_confidence=0.9, min_confidence=0.5, scope_gap="infant", topic_fit=0.9)
    assert d.intent is Intent.NO_ANSWER and d.source == "topic_scope"


def test_topic_scope_is_read_off_the_knowledge_base():
    from bot.config import load_config
    from bot.knowledge import load_knowledge_base
    from bot.topic_scope import TopicScope

    scope = TopicScope(load_knowledge_base(load_config(env={}).kb_path))
    assert "chronic.diabetes_diet" in scope.covered["diabetes"]
    assert scope.uncovered("糖尿病人可以上夜班吗", "sleep.late_night") == "diabetes"
    assert scope.uncovered("满月宝宝睡觉一惊一乍", "tcm.yin_deficiency") == "infant"
    assert scope.uncovered("满月宝宝睡觉一惊一乍", "child.sleep") is None
    assert scope.uncovered("宝宝7个月了最近大便有点干 两三天才拉一次", "family.child_constipation") is None  # reviewed
    assert scope.uncovered("手脚冰凉怎么办", "body.cold_hands_feet") is None
    # hepatitis A is another disease than hepatitis B: the hepatitis B topic does not answer it
    assert scope.uncovered("how serious is hepatitis a?", "living.hepatitis_b") == "other_hepatitis"
    assert scope.uncovered("乙肝携带者饮食要注意什么", "living.hepatitis_b") is None
    # 肾虚 is a TCM idea: the kidney-disease diet does not answer it, the cold-hands topic may
    assert scope.uncovered("肾虚怎么补", "longterm.ckd_diet") == "tcm_kidney"
    assert scope.uncovered("肾阳虚手脚冰凉怎么调理", "body.cold_hands_feet") is None
    assert scope.uncovered("慢性肾病饮食注意什么", "longterm.ckd_diet") is None
    # 试管婴儿 (IVF) names no baby, 玻尿酸 (hyaluronic acid) is not uric acid: a pregnancy topic answers
    # "试管婴儿怀上了 孕吐厉害", the acne topic "打过玻尿酸 脸上长痘"
    assert scope.uncovered("做试管婴儿怀孕的 孕吐厉害怎么办", "pregnancy.morning_sickness") is None
    assert scope.uncovered("打过玻尿酸 最近脸上长痘痘怎么办", "body.acne") is None
    assert scope.uncovered("婴儿湿疹怎么护理", "body.acne") == "infant"
    assert scope.uncovered("尿酸高 晚上睡不着怎么办", "sleep.insomnia") == "gout"
    assert scope.uncovered("每到满月前后就失眠 怎么回事", "sleep.insomnia") is None  # the moon
    assert scope.uncovered("宝宝刚满月 晚上老哭", "sleep.insomnia") == "infant"
    assert scope.uncovered("keep getting ulcers in my mouth", "body.mouth_ulcer") is None
    assert scope.uncovered("i have piles of work every night and cant fall asleep", "sleep.insomnia") is None
    assert scope.uncovered("my piles hurt when i sit", "sleep.insomnia") == "hemorrhoids"
    assert scope.uncovered("living with a stomach ulcer, what should i eat", "nutri.breakfast") == "gastric_disease"


def test_the_safety_net_travels_in_the_json_and_between_replicas():
    from bot.types import Reply

    reply = Reply("text", Intent.ANSWER, "zh", topic="child.fever_care", safety_net=("child",))
    assert reply.as_dict()["safety_net"] == ["child"]
    assert Reply.from_json(reply.to_json()) == reply
    assert Reply("hi", Intent.GREETING).as_dict()["safety_net"] == []


def test_an_answerable_question_that_names_a_medicine_is_referred():
    d = decide(probs(answer=0.9), CFG, rule=None, scope=False, care_team=False, off_topic=None,
               retrieval_confidence=0.9, min_confidence=0.5, names_medicine=True, topic_fit=0.9)
    assert d.intent is Intent.REFER_DOCTOR and d.source == "medicine"


def test_supplements_are_not_named_medicines():
    from safety.scope import names_medicine

    assert names_medicine("我吃的那个氨氯地平能和柚子一起吃吗") and names_medicine("can i take ibuprofen with coffee")
    assert not names_medicine("老人需要补钙片吗") and not names_medicine("should i take vitamin d in winter")
    assert not names_medicine("用刀片划了手臂") and not names_medicine("拍了照片给你看")  # a blade, a photo
    # "了一大片 / 了一小片" is a patch of skin (or mould), not a tablet: six such questions were referred
    assert not names_medicine("手背被热油溅了一下 红了一小片 有点刺痛") and not names_medicine("墙角长了一大片黑霉")
    assert not names_medicine("手肘和膝盖都擦破了一大片") and names_medicine("刚吃了一片止痛片")
    # 片 said twice is patches too ("下巴一片一片的" was referred as a dose question); tablets counted stay medicine
    assert not names_medicine("脸上长痘痘 下巴一片一片的") and not names_medicine("身上起了一片片红疹 痒")
    assert names_medicine("这个药一次吃一片还是两片")
    # what 除了 / Cantonese 除咗 leaves out is no medicine asked about ("besides taking medicine, what else?")
    assert not names_medicine("除咗食藥仲有咩方法") and not names_medicine("除了吃药还有什么方法")
    assert not names_medicine("菜上的农药残留怎么洗干净") and names_medicine("喝了农药以后又吃了安眠药")  # a pesticide
    # hormones that change are no hormone medicine; a hormone to take still is
    assert not names_medicine("更年期激素变化 晚上老出汗睡不好 怎么调理") and not names_medicine("激素失调 脸上长痘")
    assert names_medicine("医生让我吃激素 能吃多久") and names_medicine("雌激素下降了 要不要补激素")
    assert not names_medicine("要不要去医院拍个片 还是再等等") and not names_medicine("照张片看看骨头有没有事")  # an X-ray
    assert names_medicine("拍个片 顺便开点止痛片")
    # not wanting medicine, said softly, while asking for other ways (blind batch RR, 2026-12-06): answered
    assert not names_medicine("感冒了鼻塞流鼻涕 不太想吃药 有什么办法")
    assert names_medicine("不太想吃降压药 有什么办法")  # a named medicine stays with the doctor
    assert names_medicine("孩子得了手足口病 除了退烧还要吃什么药")  # asks for a medicine: 除了 leaves out the fever
    assert not names_medicine("最近insomnia好严重 有没有不吃药的tips")
    # English medicine words are whole words: 12 pillow questions of the blind batches were referred
    assert not names_medicine("wife is 30 weeks pregnant, any tips for pillows or sleeping positions?")
    assert not names_medicine("i find a bunch of hair on my pillow every morning")
    assert names_medicine("how many pills can i take") and names_medicine("two doses of tylenol a day")
    assert names_medicine("which medicines help a cold") and names_medicine("my medications make me sleepy")
    # a tablet computer is no tablet; a tablet to take still is
    assert not names_medicine("my son is on his tablet all day and his eyes are dry")
    assert not names_medicine("kids staring at tablets and phones all day") and not names_medicine("ipad or tablet before bed?")
    assert names_medicine("is the tablet safe in pregnancy") and names_medicine("he has been on the tablets for a month")


def test_an_emergency_the_message_tells_as_over_gets_the_net_and_a_crisis_never_does():
    """safety/settled.py: "前几天胸口闷了一下 现在好了" read by the head at p(emergency) 0.85."""
    p = probs(emergency=0.85, answer=0.1)
    d = decide(p, CFG, rule=None, scope=False, care_team=False, off_topic=None, retrieval_confidence=0.9,
               min_confidence=0.5, topic_fit=0.8, danger_over=True)
    assert d.intent is not Intent.EMERGENCY and d.safety_net == "emergency"
    crisis = decide(probs(crisis=0.6, answer=0.3), CFG, rule=None, scope=False, care_team=False, off_topic=None,
                    retrieval_confidence=0.9, min_confidence=0.5, topic_fit=0.8, danger_over=True)
    assert crisis.intent is Intent.EMERGENCY and crisis.kind == "crisis"
    # a red flag told as over carries the net even where the head reads no danger
    calm = decide(probs(answer=0.9), CFG, rule=None, scope=False, care_team=False, off_topic=None,
                  retrieval_confidence=0.9, min_confidence=0.5, topic_fit=0.8, danger_over=True, flagged=True)
    assert calm.intent is Intent.ANSWER and calm.safety_net == "emergency"


def test_a_runner_up_sibling_lowers_the_fit_an_answer_needs():
    """bot/decision.py ``topic_fit_sibling``: a question between two topics that both answer it."""
    p = probs(answer=0.9)
    at = (CFG.topic_fit + CFG.topic_fit_sibling) / 2
    assert run(p, fit=at).intent is Intent.NO_ANSWER
    d = decide(p, CFG, rule=None, scope=False, care_team=False, off_topic=None, retrieval_confidence=0.9,
               min_confidence=0.5, topic_fit=at, sibling=True)
    assert d.intent is Intent.ANSWER
    contested = decide(p, CFG, rule=None, scope=False, care_team=False, off_topic=None, retrieval_confidence=0.9,
                       min_confidence=0.5, topic_fit=at, sibling=True, contested=True)
    assert contested.intent is Intent.NO_ANSWER


def test_sibling_pairs_are_topics_listed_together_as_right_answers():
    from types import SimpleNamespace

    from bot.topic_fit import TopicFit, sibling_pairs

    pairs = sibling_pairs([{"topics": ["longterm.knee_oa", "firstaid.knee_pain"]}, {"topics": ["sleep.insomnia"]},
                           {"intent": "no_answer"}])
    assert pairs == {("longterm.knee_oa", "firstaid.knee_pain"), ("firstaid.knee_pain", "longterm.knee_oa")}
    fit = TopicFit(None, 1.0, {}, siblings=pairs)
    m = [SimpleNamespace(topic_id="firstaid.knee_pain"), SimpleNamespace(topic_id="longterm.knee_oa")]
    assert fit.runner_up_is_sibling(m) and not fit.runner_up_is_sibling(m[:1])
    assert not fit.runner_up_is_sibling([m[0], SimpleNamespace(topic_id="sleep.insomnia")])


@pytest.mark.parametrize("q, families", [("血压160/100 头有点晕", ("blood_pressure", "stroke")),
                                         ("my bp is 150/95", ("blood_pressure",)),
                                         ("孕36周，血压170，头很痛", ("pregnancy", "stroke")),
                                         ("产后两周 血压150/100", ("pregnancy",))])
def test_the_blood_pressure_net_line_is_not_given_in_pregnancy_or_after_a_birth(q, families):
    """"180/120: the same day" would mislead where pre-eclampsia makes a lower reading with a headache urgent
    (NHS "Pre-eclampsia"): the pregnancy family's line speaks to it."""
    assert safety_net(normalize(q).text, "zh", "emergency", "120", "12356")[0] == families
