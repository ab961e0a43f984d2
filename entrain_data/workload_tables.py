"""Small distribution tables behind the synthetic workloads, with their sources.

Each tuple is the empirical quantile function of one column of a real
per-sample table in ``../shared/data/metadata`` (see each folder's
PROVENANCE.md for the upstream repository and commit), evaluated at
:data:`QUANTILE_PROBS`; the generators sample it by inverse-CDF interpolation.
Dicts are category counts. Derived once with numpy.quantile; no rows are
copied.

Sources (folder / file / column):
- LLAVA_*: llava_instruct/llava_instruct_150k_lengths.csv, human_chars + gpt_chars by
  ``kind``, n_turns of ``conv`` records (LLaVA-Instruct-150K, Liu et al. 2023).
- COCO_*: coco_val2017/coco_val2017_images.csv, max/min of width, height; per-caption
  characters (COCO 2017 val captions).
- SROIE_*: docs_sroie/sroie_trainval_receipts.csv, width, height/width split at 2000 px
  width (full-page scans vs receipt photos), ocr_chars (ICDAR 2019 SROIE).
- LIBRISPEECH_*: librispeech_dev_clean/librispeech_dev_clean.csv, duration_s,
  transcript_chars / duration_s (LibriSpeech dev-clean).
- COMMON_VOICE_ID_*: common_voice/common_voice_id.csv, duration_s, sentence_chars
  (Common Voice, Indonesian).
- ACTIVITYNET_*: video/activitynet_captions_val.csv, duration_s, sent_chars_total.
- CHARADES_*: video/charades_v1.csv, length_s, descriptions_chars (script_chars when empty).
- NEXTQA_*: video/nextqa_valtest.csv, frame_count (30 fps), (width, height) of the 8 most
  common sizes (91 percent of videos), question_chars_mean + options_chars_mean.
- IIW_HUMAN_CHARS: long_captions_iiw/iiw_benchmark_descriptions.csv, chars of IIW_human
  descriptions (ImageInWords).
"""

from __future__ import annotations

# fmt: off
QUANTILE_PROBS = (0, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.975, 0.99, 1)

LLAVA_KIND_COUNTS = {'conv': 57165, 'complex': 77095, 'detail': 23240}
LLAVA_CONV_CHARS = (138, 389, 453, 513, 601, 803, 1033, 1294, 1588, 1833, 2066, 2294, 2567, 2764, 2930, 3119, 4974)
LLAVA_DETAIL_CHARS = (283, 413, 449, 483, 521, 566, 598, 625, 649, 675, 703, 739, 792, 840, 884, 933, 1208)
LLAVA_COMPLEX_CHARS = (41, 377, 447, 493, 547, 613, 663, 709, 755, 806, 865, 952, 1153, 1366, 1524, 1686, 2448)
LLAVA_CONV_TURN_COUNTS = {2: 242, 3: 1274, 4: 21718, 5: 33901, 6: 29, 7: 1}
COCO_LONG_SIDE = (200, 500, 500, 500, 500, 640, 640, 640, 640, 640, 640, 640, 640, 640, 640, 640, 640)
COCO_SHORT_OVER_LONG = (0.2484, 0.4969, 0.562, 0.5984, 0.6625, 0.6656, 0.6672, 0.6687, 0.7216, 0.75, 0.75, 0.75, 0.7578, 0.897, 1.0, 1.0, 1.0)
COCO_PORTRAIT_FRACTION = 0.2456
COCO_CAPTION_CHARS = (24, 34, 36, 37, 40, 43, 45, 48, 50, 53, 56, 60, 66, 74, 82, 95, 247)
SROIE_PAGE_FRACTION = 0.1342
SROIE_PAGE_WIDTH = (2481, 2481, 2658, 4854, 4945, 4961, 4961, 4961, 4961, 4961, 4961, 4961, 4961, 4961, 4961, 4961, 4961)
SROIE_PAGE_H_OVER_W = (1.3803, 1.3824, 1.3865, 1.4117, 1.4139, 1.4142, 1.4142, 1.4142, 1.4142, 1.4142, 1.4142, 1.4142, 1.4142, 1.4142, 1.4142, 1.4142, 1.4142)
SROIE_RECEIPT_WIDTH = (436, 445, 494, 584, 608, 619, 623, 708, 749, 831, 892, 932, 936, 1076, 1080, 1080, 1654)
SROIE_RECEIPT_H_OVER_W = (1.0295, 1.4136, 1.4139, 1.4148, 1.6474, 1.8251, 1.9143, 1.976, 2.0648, 2.2247, 2.349, 2.4599, 2.778, 2.9774, 3.2186, 3.4775, 3.7951)
SROIE_OCR_CHARS = (170, 332, 375, 407, 432, 477, 526, 550, 586, 622, 684, 753, 862, 905, 957, 1145, 1273)
LIBRISPEECH_SECONDS = (1.445, 1.94, 2.15, 2.371, 2.726, 3.355, 4.175, 4.908, 5.92, 7.06, 8.44, 10.163, 13.329, 16.413, 19.363, 23.755, 32.645)
LIBRISPEECH_CHARS_PER_SECOND = (2.076, 6.667, 8.13, 9.526, 10.869, 12.449, 13.366, 14.05, 14.661, 15.307, 16.004, 16.793, 17.773, 18.549, 19.269, 20.137, 23.278)
COMMON_VOICE_ID_SECONDS = (1.116, 1.776, 2.016, 2.268, 2.556, 2.916, 3.204, 3.456, 3.744, 4.056, 4.428, 4.944, 5.832, 6.66, 7.416, 8.28, 15.156)
COMMON_VOICE_ID_CHARS = (3, 14, 17, 20, 24, 30, 35, 40, 46, 52, 60, 71, 84, 93, 101, 111, 160)
ACTIVITYNET_SECONDS = (2.3, 7.34, 11.59, 17.42, 28.21, 49.38, 69.75, 92.21, 116.68, 139.02, 162.84, 186.62, 212.23, 225.75, 233.01, 237.17, 745.5)
ACTIVITYNET_CAPTION_CHARS = (67, 96, 107, 114, 124, 138, 153, 173, 194, 218, 250, 297, 385, 479, 582, 726, 1795)
CHARADES_SECONDS = (2.33, 7.12, 10.4, 15.08, 19.25, 24.88, 28.42, 30.04, 30.54, 30.96, 31.67, 33.05, 36.46, 41.0, 47.44, 56.49, 194.33)
CHARADES_TEXT_CHARS = (0, 0, 0, 0, 52, 81, 101, 119, 145, 178, 213, 249, 304, 353, 401, 463, 732)
NEXTQA_FRAMES_30FPS = (300, 311, 331, 355, 415, 541, 665, 804, 949, 1141, 1405, 1786, 2278, 2697, 2697, 2697, 5395)
NEXTQA_FRAME_SIZES = {(640, 480): 641, (640, 360): 502, (320, 240): 111, (500, 375): 58, (640, 1138): 43, (640, 362): 29, (480, 640): 22, (480, 360): 18}
NEXTQA_QA_CHARS = (69, 94, 98, 103, 108, 114, 118, 122, 125, 128, 131, 136, 143, 148, 152, 158, 175)
IIW_HUMAN_CHARS = (238, 370, 449, 519, 624, 737, 833, 933, 1040, 1162, 1282, 1453, 1663, 1920, 2074, 2386, 3151)
# fmt: on
